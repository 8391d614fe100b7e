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
the room, and an LRU bound keeps a missed drop from leaking. Compiled grammars are kept for reuse
(n > 1, repeated schemas) in a cache bounded by bytes and keyed by a digest of the source
(services/common/byte_lru.py), never by the source itself.

Cost: one grammar's mask can take seconds (a regex like `((a{60}){60}){60}`), and the batch
waits for every row. The router refuses grammars whose first mask overruns its budget; here, a
row whose matcher work (extension and mask) takes more than `step_budget` seconds of the engine
thread's CPU is an overrun: its row allows only the end of sequence, and the worker fails that
room alone (`take_overruns`), so one grammar never costs the other rooms more than one step.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Hashable, Sequence

import llguidance

# The numpy helpers, not llguidance.torch: that module wraps a kernel in torch.compile at import,
# which loads torch._dynamo (about a second of every worker's start) for a function not used here.
import llguidance.numpy
import torch

from services.common.byte_lru import ByteLRU, source_key
from services.common.grammar_spec import GrammarError, build_tokenizer, to_llguidance

__all__ = ["GrammarError", "GrammarRegistry", "build_tokenizer"]

MAX_CACHED_MATCHERS = 4096  # rooms; far above any worker's concurrent requests
COMPILED_CACHE_BYTES = 128 * 1024 * 1024  # compiled grammars kept for reuse, by their estimated size
# A compiled matcher's memory is not exposed: estimated from its source (lexer and parser tables
# grow with it) plus a floor for the tokenizer trie walk state
MATCHER_BYTES_PER_SOURCE_BYTE = 8
MATCHER_BASE_BYTES = 64 * 1024
DEFAULT_STEP_BUDGET = 0.2  # seconds of engine-thread CPU one row's matcher work may take per step


class _Entry:
    __slots__ = ("matcher", "consumed", "grammar")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: tuple[str, str]):
        self.matcher, self.consumed, self.grammar = matcher, [], grammar


class GrammarRegistry:
    """Matchers per room, rebuilt from ids on demand. `allowed_mask` runs on the engine thread;
    `forget` may run on the event loop, hence the lock."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int,
                 step_budget: float = DEFAULT_STEP_BUDGET, compiled_cache_bytes: int = COMPILED_CACHE_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.step_budget = step_budget  # <= 0: no budget
        self.compiled = ByteLRU(compiled_cache_bytes)
        self._rooms: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._overruns: dict[Hashable, float] = {}  # room -> CPU seconds of the step that overran
        self.rebuilds = 0  # matchers built from scratch for a room (tests and logs read it)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def compile(self, grammar: tuple[str, str]) -> llguidance.LLMatcher:
        """The grammar's fresh matcher (compiled once, then copied). Raises GrammarError."""
        key = source_key(*grammar)
        template = self.compiled.get(key)
        if template is not None:
            return template.deep_copy()
        template = llguidance.LLMatcher(self.tokenizer, to_llguidance(*grammar), log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        self.compiled.put(key, template, MATCHER_BASE_BYTES + MATCHER_BYTES_PER_SOURCE_BYTE * len(grammar[1]))
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
        bits = llguidance.numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        errors = []
        for i, (key, grammar, generated) in enumerate(rows):
            started = time.thread_time()
            matcher = self._matcher(key, grammar, generated)
            if matcher.is_error():
                errors.append(i)
                continue
            llguidance.numpy.fill_next_token_bitmask(matcher, bits, i)
            spent = time.thread_time() - started
            if key is not None and 0 < self.step_budget < spent:  # without a room there is no one to fail
                errors.append(i)
                with self._lock:
                    self._overruns[key] = spent
        mask = ((torch.from_numpy(bits).unsqueeze(-1) >> self._shifts) & 1).flatten(1)[:, : self.vocab_size].bool()
        for i in errors:
            mask[i] = False
            mask[i, self.tokenizer.eos_tokens] = True
        return mask

    def allowed_mask(self, key: Hashable | None, grammar: tuple[str, str], generated: Sequence[int]) -> torch.Tensor:
        """One row of allowed_masks."""
        return self.allowed_masks([(key, grammar, generated)])[0]

    def take_overruns(self) -> dict[Hashable, float]:
        """Rooms whose matcher work overran the step budget since the last call (room -> CPU
        seconds of that step); the caller fails them."""
        with self._lock:
            out, self._overruns = self._overruns, {}
        return out

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._rooms.pop(key, None)
            self._overruns.pop(key, None)

    def __len__(self) -> int:
        return len(self._rooms)
