"""Grammar texts for structured output, torch-free: the router checks a request's grammar with
these before any worker sees it; services/engine/grammar.py compiles the same text per tokenizer.

A grammar travels as (kind, source): "json_schema" (the schema as JSON text), "regex" or "lark"
(llguidance's Lark dialect, which may embed JSON schemas with `%json { ... }`).
"""

from __future__ import annotations

import functools
import json

import llguidance


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
    raise GrammarError(f"unknown grammar kind {kind!r}")


@functools.lru_cache(maxsize=512)
def validate(kind: str, source: str) -> str | None:
    """None when the grammar compiles, else llguidance's message (no tokenizer needed). Cached:
    clients tend to send the same schema request after request, and the router checks each."""
    try:
        grammar = to_llguidance(kind, source)
    except ValueError as e:  # GrammarError included
        return str(e)
    message = llguidance.LLMatcher.validate_grammar(grammar)  # "" when valid
    return message or None


def choice_grammar(choices: list[str]) -> tuple[str, str]:
    """Exactly one of `choices` (a Lark alternation of string literals, JSON-escaped)."""
    return "lark", "start: " + " | ".join(json.dumps(c) for c in choices)
