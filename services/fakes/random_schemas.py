"""Seeded random JSON schemas for structured-output tests and bench/engine.py: nested objects,
arrays, enums, numbers with bounds, strings, booleans, required fields. Sizes are bounded
(maxLength, maxItems, depth) so a tiny model's replies end well within max_tokens."""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "beta", "gamma", "delta", "name", "count", "items", "kind", "value", "tags", "ok", "id")


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "integer", "number", "boolean", "enum", "enum"))
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        # multipleOf bounds the fraction's digits: without it a tiny model may write digits forever
        return {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": rng.choice((0.5, 0.25, 0.125))}  # binary fractions: jsonschema checks them exactly
    if kind == "boolean":
        return {"type": "boolean"}
    values = rng.sample(WORDS, rng.randint(1, 4))
    if rng.random() < 0.3:
        values += [rng.randint(0, 9), None]
    return {"enum": values}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return random_object(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def random_object(rng: random.Random, depth: int = 2) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: _node(rng, depth) for n in names},
        "required": sorted(rng.sample(names, rng.randint(0, len(names)))),
        "additionalProperties": False,
    }


def random_schema(seed: int) -> dict[str, Any]:
    return random_object(random.Random(seed))
