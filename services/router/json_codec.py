"""The JSON the router writes: orjson, with the standard library for what orjson refuses.

The router encodes every response body and every SSE event; bench/json_codecs.py measures
orjson at 16-24x the standard library's speed on those payloads (msgspec 10-14x). orjson writes
UTF-8 without escaping, compact, like `json.dumps(..., ensure_ascii=False, separators=(",", ":"))`
(Starlette's JSONResponse); a float that is not finite becomes null, where the standard library
would raise mid-response. What orjson cannot encode at all — a string with a lone surrogate, an
integer beyond 64 bits — falls back to the standard library (escaped ASCII), so no input the parser accepted can
fail here. Request bodies are still parsed by the standard library: its acceptance rules are the
router's documented ones (a `NaN` literal reaches field validation and is refused there, naming
the field), and parsing is a small part of a request's cost.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # ASCII with escapes: a lone surrogate is not UTF-8, but "\\ud800" is JSON
        return json.dumps(value, separators=(",", ":")).encode("ascii")
