"""services/common/parent_death.py with real processes: a child armed between fork and exec dies
when its parent is SIGKILLed, also while it is stopped (SIGSTOP) before running any code of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_router_app import wait_for

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
# the parent: starts `sleep 600` armed by arm_in_child, prints its pid, then waits to be killed
PARENT = """
import os, subprocess, sys, time
from services.common.parent_death import arm_in_child
child = subprocess.Popen(["sleep", "600"], preexec_fn=arm_in_child(os.getpid()) if sys.argv[1] == "armed" else None)
print(child.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def child_of_killed_parent(mode: str, stop_child: bool) -> int:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    wait_for(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"), 10, "the child to exec")
    if stop_child:
        os.kill(child, signal.SIGSTOP)
    parent.kill()
    parent.wait(10)
    parent.stdout.close()
    return child


@pytest.mark.parametrize("stop_child", [False, True])
def test_an_armed_child_dies_with_its_sigkilled_parent(stop_child):
    child = child_of_killed_parent("armed", stop_child)
    try:
        wait_for(lambda: gone(child), 10, "the child to die with its parent")
    finally:
        if not gone(child):
            os.kill(child, signal.SIGKILL)


def test_without_arming_the_child_outlives_its_parent():
    """The control: what the arming prevents."""
    child = child_of_killed_parent("bare", stop_child=False)
    try:
        time.sleep(0.5)  # nothing to wait on: the claim is that nothing happens
        assert not gone(child)
    finally:
        os.kill(child, signal.SIGKILL)
