"""--log-format: human-readable lines when stderr is a terminal, JSON lines otherwise; every service
has the flag and its PDMESH_LOG_FORMAT twin."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from services.common.logging_setup import configure_logging, get_logger, resolve_log_format
from services.launch.proc import run_service


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_format_resolution(monkeypatch):
    monkeypatch.delenv("PDMESH_LOG_FORMAT", raising=False)
    assert resolve_log_format("auto", _Tty()) == "console"
    assert resolve_log_format("auto", io.StringIO()) == "json"
    assert resolve_log_format("json", _Tty()) == "json"
    assert resolve_log_format("console", io.StringIO()) == "console"
    monkeypatch.setenv("PDMESH_LOG_FORMAT", "console")
    assert resolve_log_format(None, io.StringIO()) == "console"
    assert resolve_log_format("json", io.StringIO()) == "json"  # the flag wins over its twin
    with pytest.raises(ValueError, match="auto, console, json"):
        resolve_log_format("yaml", io.StringIO())


def _log_lines(fmt: str, stream) -> list[str]:
    monkey_stderr, sys.stderr = sys.stderr, stream
    try:
        configure_logging("info", fmt, service="prefill", worker="w1")
        get_logger("t").info("request finished", room=7, tokens=3)
        logging.getLogger("nixl").warning("stdlib line")
    finally:
        sys.stderr = monkey_stderr
        configure_logging("info", "json")
    return stream.getvalue().splitlines()


def test_json_lines_when_not_a_terminal():
    lines = _log_lines("auto", io.StringIO())
    records = [json.loads(line) for line in lines]
    assert records[0]["event"] == "request finished" and records[0]["room"] == 7
    assert records[0]["service"] == "prefill" and records[0]["level"] == "info"
    assert records[1]["event"] == "stdlib line" and records[1]["logger"] == "nixl"


def test_console_lines_in_a_terminal(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    lines = _log_lines("auto", _Tty())
    assert len(lines) == 2
    assert "request finished" in lines[0] and "room=7" in lines[0] and "service=prefill" in lines[0]
    assert not lines[0].lstrip().startswith("{")
    assert "stdlib line" in lines[1]


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_every_service_has_the_log_format_flag(role):
    out = run_service(role, ["--help"])
    assert "--log-format" in out.stdout and "PDMESH_LOG_FORMAT" in out.stdout
