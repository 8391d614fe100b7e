"""The JSON log lines' processors (services/common/log_processors.py) write exactly what
structlog's own processors write."""

from __future__ import annotations

import datetime
import io
import json
import sys

import structlog

from services.common import log_processors
from services.common.logging_setup import bound_room, configure_logging, get_logger


class _Odd:
    def __repr__(self) -> str:
        return "<odd>"


EVENTS = [
    {"event": "request done", "status": 200, "ttft_s": 0.0012, "e2e_s": 1e-05, "finish_reason": None, "ok": True},
    {"event": "naïve ☃ \u2028 \x00 \"quoted\"", "big": 10**30, "neg": -1.5e300, "inf": float("inf"),
     "nan": float("nan")},
    {"event": "nested", "list": [1, [2, {"a": (3, 4)}]], "obj": _Odd(), "set_repr": {"k": _Odd()}},
    {"event": "surrogate \ud800", 7: "int key", None: "none key"},
]


def test_the_renderer_writes_what_jsonrenderer_writes():
    ours, theirs = log_processors.JSONLineRenderer(), structlog.processors.JSONRenderer()
    for event in EVENTS:
        assert ours(None, "info", dict(event)) == theirs(None, "info", dict(event))


def test_the_renderer_refuses_a_circular_value_as_jsonrenderer_does():
    loop: list = []
    loop.append(loop)
    for render in (log_processors.JSONLineRenderer(), structlog.processors.JSONRenderer()):
        try:
            render(None, "info", {"event": "x", "loop": loop})
        except ValueError as e:
            assert "Circular" in str(e)
        else:
            raise AssertionError("a circular value was rendered")


def test_the_timestamp_is_isoformat_in_utc():
    second = 1_778_333_036 * 1_000_000_000
    for ns in (0, second, second + 999, second + 1000, second + 123_456_789, second + 999_999_999,
               second + 1_000_000_000, 4_102_444_800 * 1_000_000_000 + 5_000):
        s, rest = divmod(ns, 1_000_000_000)
        expected = datetime.datetime.fromtimestamp(s, tz=datetime.UTC).replace(microsecond=rest // 1000)
        assert log_processors.iso_utc(ns) == expected.isoformat().replace("+00:00", "Z"), ns


def test_the_stamp_processor_fills_the_timestamp_key():
    before = datetime.datetime.now(tz=datetime.UTC)
    stamped = log_processors.iso_utc_timestamp(None, "info", {})["timestamp"]
    after = datetime.datetime.now(tz=datetime.UTC)
    at = datetime.datetime.fromisoformat(stamped.replace("Z", "+00:00"))
    assert before.replace(microsecond=0) <= at <= after


def test_merge_reads_what_structlogs_merge_reads():
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service="router", gone="x")
    structlog.contextvars.unbind_contextvars("gone")
    with bound_room(255):
        for event in ({"event": "e"}, {"event": "e", "room": "the call's own"}):
            ours = log_processors.merge_contextvars(None, "info", dict(event))
            theirs = structlog.contextvars.merge_contextvars(None, "info", dict(event))
            assert ours == theirs
            assert "gone" not in ours and ours["service"] == "router"
        structlog.contextvars.bind_contextvars(fresh_name_after_a_merge=1)  # a name new to the registry
        assert log_processors.merge_contextvars(None, "info", {})["fresh_name_after_a_merge"] == 1
    structlog.contextvars.clear_contextvars()
    assert log_processors.merge_contextvars(None, "info", {}) == {}


def test_a_configured_json_line_parses_with_every_field():
    stream, saved = io.StringIO(), sys.stderr
    sys.stderr = stream
    try:
        configure_logging("info", "json", service="router")
        with bound_room(10):
            get_logger("t").info("attempt", attempt=0, prefill="a:1")
    finally:
        sys.stderr = saved
        configure_logging("info", "json")
    line = stream.getvalue()
    assert line.endswith("}\n") and line.count("\n") == 1 and '"event": "attempt"' in line
    record = json.loads(line)
    assert record["room"] == 10 and record["request_id"] == "a" and record["service"] == "router"
    assert record["level"] == "info" and record["timestamp"].endswith("Z") and record["prefill"] == "a:1"
