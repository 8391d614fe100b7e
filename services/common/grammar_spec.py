"""Grammar texts for structured output, torch-free: the router checks a request's grammar with
these before any worker sees it; services/engine/grammar.py compiles the same text per tokenizer.

A grammar travels as (kind, source): "json_schema" (the schema as JSON text), "regex", "lark"
(llguidance's Lark dialect, which may embed JSON schemas with `%json { ... }`) or "llguidance"
(llguidance's own JSON: a list of grammars, the first the start one, referring to the others by
name; the router composes these, clients never send them).
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance

from services.common.byte_lru import ByteLRU, source_key
from services.common.tokenizer import Tokenizer


class GrammarError(ValueError):
    """The grammar does not compile."""


def to_llguidance(kind: str, source: str) -> str:
    """The llguidance grammar text for a (kind, source) of SamplingParams.grammar."""
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            # compact JSON (no whitespace: {"a":1,"b":2}): with free whitespace a model can spend
            # its whole max_tokens on newlines inside a valid-so-far prefix
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if kind in ("regex", "lark"):
        return llguidance.grammar_from(kind, source)
    if kind == "llguidance":
        try:
            grammars = json.loads(source).get("grammars")
        except (ValueError, AttributeError):
            grammars = None
        if not isinstance(grammars, list) or not grammars:
            raise GrammarError("an llguidance grammar is a JSON object with a non-empty 'grammars' list")
        return source
    raise GrammarError(f"unknown grammar kind {kind!r}")


# Verdicts of validate(), keyed by a digest of the grammar: a few bytes each, never the source
VALIDATION_CACHE_BYTES = 4 * 1024 * 1024
_validated = ByteLRU(VALIDATION_CACHE_BYTES)


def validate(kind: str, source: str) -> str | None:
    """None when the grammar compiles, else llguidance's message (no tokenizer needed). Cached by
    a digest of the grammar, within VALIDATION_CACHE_BYTES: clients tend to send the same schema
    request after request, and the router checks each."""
    key = source_key("validate", kind, source)
    verdict = _validated.get(key)
    if verdict is None:
        try:
            verdict = llguidance.LLMatcher.validate_grammar(to_llguidance(kind, source))  # "" when valid
        except ValueError as e:  # GrammarError included
            verdict = str(e) or "invalid grammar"
        _validated.put(key, verdict, len(verdict))
    return verdict or None


def choice_grammar(choices: list[str]) -> tuple[str, str]:
    """Exactly one of `choices` (a Lark alternation of string literals, JSON-escaped)."""
    return "lark", "start: " + " | ".join(json.dumps(c) for c in choices)


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
