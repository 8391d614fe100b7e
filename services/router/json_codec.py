"""The JSON the router writes: orjson, with the standard library for what orjson refuses.

The router encodes every response body and every SSE event; bench/json_codecs.py measures
orjson at 16-24x the standard library's speed on those payloads (msgspec 10-14x). orjson writes
UTF-8 without escaping, compact, like `json.dumps(..., ensure_ascii=False, separators=(",", ":"))`
(Starlette's JSONResponse); a float that is not finite becomes null, where the standard library
would raise mid-response. What orjson cannot encode at all — a string with a lone surrogate, an
integer beyond 64 bits — falls back to the standard library (escaped ASCII), so no input the parser accepted can
fail here.

Request bodies are parsed with the standard library's acceptance rules (a `NaN` literal reaches
field validation and is refused there, naming the field; an integer of any size stays an
integer; a UTF-16 body parses), through orjson wherever it gives the same value: `loads` tries
orjson first (3-5x faster, bench/json_codecs.py), and takes the standard library's answer, or
its error, whenever orjson refuses the text — the non-JSON literals, a lone surrogate, a byte
order mark, UTF-16/32, nesting past orjson's limit. The one text orjson accepts with another
value is an integer beyond 64 bits (a float there): a body with a run of 19 digits or more goes
to the standard library alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # may be an integer orjson would turn into a float


def loads(raw: bytes) -> Any:
    """json.loads(raw): the same value, or the same exception."""
    if _LONG_DIGITS.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # ASCII with escapes: a lone surrogate is not UTF-8, but "\\ud800" is JSON
        return json.dumps(value, separators=(",", ":")).encode("ascii")
