"""Test ports: below the ephemeral range, and under pytest-xdist each worker in its own slice, so
test files running side by side (and the processes they start) never take one another's ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.launch.ports import port_range

ROOT = Path(__file__).resolve().parents[2]


def test_each_xdist_worker_gets_its_own_slice():
    slices = [port_range(20000, 32000, {"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": "3"})
              for i in range(3)]
    assert slices == [(20000, 24000), (24000, 28000), (28000, 32000)]
    assert port_range(20000, 32000, {}) == (20000, 32000)  # not under xdist: the whole range
    # nonsense or too many workers for the range: the whole range, never an empty one
    assert port_range(20000, 32000, {"PYTEST_XDIST_WORKER": "gw5", "PYTEST_XDIST_WORKER_COUNT": "2"}) == (20000, 32000)
    assert port_range(20000, 20150, {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}) == (20000, 20150)
    assert port_range(20000, 32000, {"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "2"}) == (20000, 32000)


def test_a_process_started_by_a_worker_takes_ports_from_that_workers_slice():
    code = ("from services.launch import ports\n"
            "print(ports._low, ports._high, *[ports.free_port() for _ in range(50)])")
    slices = []
    for worker in ("gw0", "gw1"):
        env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": "2"}
        low, high, *ports = map(int, subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                                                    text=True, timeout=60, check=True).stdout.split())
        assert len(set(ports)) == 50 and all(low <= p < high for p in ports), (worker, low, high, ports)
        slices.append((low, high))
    (low0, high0), (low1, high1) = slices
    assert high0 - low0 >= 100 and high0 <= low1 < high1, slices  # two slices, side by side
