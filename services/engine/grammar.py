"""Structured output: a grammar (JSON schema, regex or Lark) that every sampled token must respect.

llguidance (Microsoft's grammar engine, also a vLLM and SGLang backend) does the work: a matcher
per request says which tokens may come next, as a bitmask over the vocabulary. We picked it over
xgrammar because its wheel (3 MB, abi3) installs beside the pinned CPU torch with no other
dependency, while xgrammar pulls triton.

Disaggregation: the first token is sampled on prefill, the rest on decode, and a request may be
retracted or migrate to another pair. The matcher's state is never shipped: it is a function of the
grammar and the ids generated so far, so any worker rebuilds it by feeding those ids to a fresh
matcher. A per-room cache keeps decode's per-token cost O(1): it holds the matcher and the ids it
consumed, extends it when the request's ids extend them, and rebuilds it otherwise (a migrated
request arriving with generated ids, a resumed one). Entries are dropped when the worker releases
the room, and an LRU bound keeps a missed drop from leaking.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path

import llguidance
import llguidance.torch
import torch

from services.common.grammar_spec import GrammarError, to_llguidance
from services.common.tokenizer import Tokenizer

__all__ = ["GrammarError", "GrammarRegistry", "build_tokenizer"]

MAX_CACHED_MATCHERS = 4096  # rooms; far above any worker's concurrent requests
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept for reuse (n > 1, repeated schemas)


def build_tokenizer(tokenizer: Tokenizer, model_dir: Path | None, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: the bytes of every token id below the model's vocab."""
    eos = list(tokenizer.eos_token_ids) or None
    tokenizer_json = model_dir / "tokenizer.json" if model_dir is not None else None
    if tokenizer_json is not None and tokenizer_json.is_file():
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(tokenizer, vocab_size))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


class _ByteTokenizer:
    """The shape llguidance.TokenizerWrapper reads, for tokenizers without a tokenizer.json
    (the byte-level `builtin-random` one): token bytes by id, special ids, encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [t for t in range(vocab_size) if tokenizer.is_special(t)]
        self.tokens = [
            tokenizer.decode([t], skip_special_tokens=False).encode() if t in self.special_token_ids
            else bytes([t]) if t < 256 else b""
            for t in range(vocab_size)
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class _Entry:
    __slots__ = ("matcher", "consumed", "grammar")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: tuple[str, str]):
        self.matcher, self.consumed, self.grammar = matcher, [], grammar


class GrammarRegistry:
    """Matchers per room, rebuilt from ids on demand. `allowed_mask` runs on the engine thread;
    `forget` may run on the event loop, hence the lock."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = collections.OrderedDict()
        self._rooms: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.rebuilds = 0  # matchers built from scratch for a room (tests and logs read it)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def compile(self, grammar: tuple[str, str]) -> llguidance.LLMatcher:
        """The grammar's fresh matcher (compiled once, then copied). Raises GrammarError."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return template.deep_copy()
        template = llguidance.LLMatcher(self.tokenizer, to_llguidance(*grammar), log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _matcher(self, key: Hashable | None, grammar: tuple[str, str], generated: Sequence[int]) -> llguidance.LLMatcher:
        with self._lock:
            entry = self._rooms.get(key) if key is not None else None
            if entry is not None:
                self._rooms.move_to_end(key)
        n = len(entry.consumed) if entry is not None else 0
        if entry is None or entry.grammar != grammar or n > len(generated) or list(generated[:n]) != entry.consumed:
            entry, n = _Entry(self.compile(grammar), grammar), 0
            self.rebuilds += 1
        rest = list(generated[n:])
        if rest:
            entry.matcher.consume_tokens(rest)
            entry.consumed.extend(rest)
        if key is not None:
            with self._lock:
                self._rooms[key] = entry
                self._rooms.move_to_end(key)
                while len(self._rooms) > MAX_CACHED_MATCHERS:
                    self._rooms.popitem(last=False)
        return entry.matcher

    def allowed_masks(self, rows: Sequence[tuple[Hashable | None, tuple[str, str], Sequence[int]]]) -> torch.Tensor:
        """Bool masks [len(rows), vocab]: per (key, grammar, generated ids), the tokens that keep the
        output in the grammar. One bitmask for the batch, unpacked in one go. A matcher in error
        (ids the grammar never allowed, e.g. a client-forced prefix) allows only the end of
        sequence, so the request ends instead of failing the batch."""
        bits = llguidance.torch.allocate_token_bitmask(len(rows), self.vocab_size)
        errors = []
        for i, (key, grammar, generated) in enumerate(rows):
            matcher = self._matcher(key, grammar, generated)
            if matcher.is_error():
                errors.append(i)
            else:
                llguidance.torch.fill_next_token_bitmask(matcher, bits, i)
        mask = ((bits.unsqueeze(-1) >> self._shifts) & 1).flatten(1)[:, : self.vocab_size].bool()
        for i in errors:
            mask[i] = False
            mask[i, self.tokenizer.eos_tokens] = True
        return mask

    def allowed_mask(self, key: Hashable | None, grammar: tuple[str, str], generated: Sequence[int]) -> torch.Tensor:
        """One row of allowed_masks."""
        return self.allowed_masks([(key, grammar, generated)])[0]

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._rooms.pop(key, None)

    def __len__(self) -> int:
        return len(self._rooms)
