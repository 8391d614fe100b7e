"""Killing a stopped (SIGSTOPped) process: without grace it dies where it stands, never resumed
first (resumed, a frozen decode ran on for the moment before the SIGKILL and finished the stream
it was killed to cut off); with grace it is resumed only after its SIGTERM is pending, and
handles that."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from services.launch.probes import process_state, wait_for
from services.launch.proc import Proc

pytestmark = pytest.mark.timeout(30)

CHILD = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_term(*_):
    out.write_text("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
out.write_text("ready")
while True:
    time.sleep(0.01)
"""


def _stopped_child(tmp_path: pathlib.Path) -> tuple[Proc, pathlib.Path]:
    out = tmp_path / "out"
    popen = subprocess.Popen([sys.executable, "-c", CHILD, str(out)])
    wait_for(lambda: out.exists() and out.read_text() == "ready", 10, "the child to start")
    proc = Proc("fakes", popen, None, 0)
    proc.stop()
    wait_for(lambda: process_state(popen.pid) == "T", 5, "the child to stop")
    return proc, out


def _signals(monkeypatch) -> list[int]:
    sent: list[int] = []
    real = os.kill

    def recording(pid, sig):
        sent.append(sig)
        real(pid, sig)

    monkeypatch.setattr(os, "kill", recording)
    return sent


def test_a_kill_without_grace_never_resumes_a_stopped_process(tmp_path, monkeypatch):
    proc, out = _stopped_child(tmp_path)
    sent = _signals(monkeypatch)
    proc.kill()
    assert proc.popen.returncode == -signal.SIGKILL
    assert signal.SIGCONT not in sent and sent == [signal.SIGKILL]
    assert out.read_text() == "ready"


def test_a_kill_with_grace_resumes_a_stopped_process_with_its_sigterm_pending(tmp_path, monkeypatch):
    proc, out = _stopped_child(tmp_path)
    sent = _signals(monkeypatch)
    proc.kill(grace=10)
    assert sent[:2] == [signal.SIGTERM, signal.SIGCONT]
    assert proc.popen.returncode == 0 and out.read_text() == "terminated"  # its handler ran: a clean exit
