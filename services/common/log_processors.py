"""structlog processors for the JSON log lines, each writing exactly what structlog's own writes,
for less CPU: the router logs two lines per request ("attempt", "request done"), and structlog's
processors were a tenth of the router's own CPU per request at high rates (measured with py-spy).

- `merge_contextvars`: structlog's walks every context variable of the process (asyncio's,
  grpc's, ...) and tests each name's prefix; this reads structlog's own variables only.
- `iso_utc_timestamp`: TimeStamper(fmt="iso", utc=True)'s text, the date and time of day made
  once per second instead of a datetime built and formatted per line.
- `JSONLineRenderer`: JSONRenderer's text (json.dumps with structlog's fallback for what JSON
  cannot hold), with the encoder's settings bound once instead of per line.
"""

from __future__ import annotations

import json
import time
from json.encoder import c_make_encoder, encode_basestring_ascii
from typing import Any

import structlog.contextvars
from structlog.processors import _json_fallback_handler

_PREFIX_LEN = len(structlog.contextvars.STRUCTLOG_KEY_PREFIX)
# structlog's registry of its context variables: it only grows (unbinding sets a variable to ...,
# structlog's "unset"), so its size tells when the stripped names below are out of date
_REGISTRY = structlog.contextvars._CONTEXT_VARS
_known: list[tuple[str, Any]] = []


def merge_contextvars(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog.contextvars.merge_contextvars: the bound context under what the call did not set."""
    global _known
    if len(_known) != len(_REGISTRY):
        # a copy (one C call): another thread may bind a new name while this one iterates
        _known = [(name[_PREFIX_LEN:], var) for name, var in list(_REGISTRY.items())]
    for key, var in _known:
        value = var.get()
        if value is not Ellipsis:
            event_dict.setdefault(key, value)
    return event_dict


_second = -1
_second_text = ""


def iso_utc_timestamp(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict["timestamp"] = iso_utc(time.time_ns())
    return event_dict


def iso_utc(ns: int) -> str:
    """datetime.now(timezone.utc).isoformat() with "Z" for "+00:00", at `ns` since the epoch:
    microseconds floored, as datetime.now reads the clock, and left out when they are zero, as
    isoformat does."""
    global _second, _second_text
    seconds, nanos = divmod(ns, 1_000_000_000)
    if seconds != _second:
        _second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second = seconds
    micros = nanos // 1000
    return f"{_second_text}.{micros:06d}Z" if micros else f"{_second_text}Z"


class JSONLineRenderer:
    """structlog.processors.JSONRenderer() with its defaults: json.dumps(event_dict,
    default=structlog's fallback) — ASCII with escapes, ", " and ": " between items."""

    def __init__(self) -> None:
        self._encode = c_make_encoder  # None on a Python without the C encoder: the plain call then

    def __call__(self, logger: Any, method_name: str, event_dict: dict[str, Any]) -> str:
        if self._encode is None:
            return json.dumps(event_dict, default=_json_fallback_handler)
        # the arguments json.JSONEncoder.iterencode passes for json.dumps' defaults; a fresh
        # markers dict per line, as there, for its circular-reference check
        chunks = self._encode({}, _json_fallback_handler, encode_basestring_ascii, None, ": ", ", ", False, False,
                              True)(event_dict, 0)
        return "".join(chunks)
