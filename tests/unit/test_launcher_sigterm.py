"""A process that launched others and is sent SIGTERM (`timeout`, a CI job ending) stops them on
its way out, as on Ctrl-C: its children run in sessions of their own, and nothing else would
(services/launch/terminate.py)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from services.launch.probes import process_state

ROOT = pathlib.Path(__file__).resolve().parents[2]

# a bench's shape: a launcher, a long-lived child, the stop in a finally
SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from services.launch.launcher import Launcher
launcher = Launcher(log_dir={logs!r})
try:
    child = launcher.spawn("server", ["0", "--bind", "127.0.0.1"], 0, None, module="http.server")
    print(child.popen.pid, flush=True)
    time.sleep(120)
finally:
    launcher.stop()
    print("stopped", flush=True)
"""


def _alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


def test_sigterm_to_the_launching_process_stops_its_children(tmp_path):
    script = tmp_path / "bench_like.py"
    script.write_text(SCRIPT.format(root=str(ROOT), logs=str(tmp_path)))
    runner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(runner.stdout.readline())
        assert _alive(child)
        runner.send_signal(signal.SIGTERM)
        out, _ = runner.communicate(timeout=30)
        assert "stopped" in out, out
        until = time.monotonic() + 10
        while _alive(child) and time.monotonic() < until:
            time.sleep(0.05)
        assert not _alive(child), "the launcher's child outlived it"
    finally:
        if runner.poll() is None:
            runner.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
