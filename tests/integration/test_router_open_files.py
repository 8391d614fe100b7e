"""The router's connection bound acts before the process runs out of file descriptors, whatever
open-files limit it was started with (real router process, fake workers, raw sockets):

- a soft limit below what --max-connections needs, under a high hard limit (Docker 25+ starts
  containers at a soft 1,024): the router raises its soft limit and serves --max-connections;
- a hard limit that is too low as well: the router serves fewer connections, says so in its log,
  and idle connections past that number still make room for a new client instead of keeping
  it out (accept() failing with EMFILE, as it did before the router sized itself);
- a real worker raises its soft limit too, and warns when the hard limit holds it low.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from services.launch.launcher import Launcher
from services.launch.probes import scrape_metrics, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NORMAL = {"model": "pdmesh-tiny", "prompt": [1, 2, 3], "max_tokens": 2}


def soft_limit(pid: int) -> int:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line")


def idle_connections(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(s)
    return socks


def closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0.05)
    try:
        return s.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def test_a_low_soft_limit_is_raised(tmp_path):
    with Launcher(log_dir=tmp_path) as mesh:
        _, prefill, decode = mesh.start_fake_workers()
        router = mesh.start_router([prefill], [decode], "--max-connections", "2000",
                                   prefix=("prlimit", "--nofile=256:8192"))
        assert soft_limit(router.popen.pid) == 2000 + 256
        assert "open-files limit" not in router.log()
        r = httpx.post(router.http_url + "/v1/completions", json=NORMAL, timeout=10)
        assert r.status_code == 200 and scrape_metrics(router.http_url)["pdmesh:router_num_running_reqs"] == 0


def test_a_low_hard_limit_shrinks_the_connection_bound_instead_of_locking_clients_out(tmp_path):
    with Launcher(log_dir=tmp_path) as mesh:
        _, prefill, decode = mesh.start_fake_workers()
        router = mesh.start_router([prefill], [decode], "--header-timeout", "60", "--keep-alive-timeout", "60",
                                   prefix=("prlimit", "--nofile=256:256"))
        assert soft_limit(router.popen.pid) == 256
        assert "open-files limit is 256" in router.log() and "at most 192 connections" in router.log()
        idle = idle_connections(router.http_port, 300)  # more than the descriptors the router has
        try:
            t0 = time.monotonic()
            for _ in range(3):  # new clients are served: the longest-idle connections make room
                r = httpx.post(router.http_url + "/v1/completions", json=NORMAL, timeout=10)
                assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 10
            wait_for(lambda: sum(closed_by_peer(s) for s in idle) >= 100, 10, "idle connections closed for room")
            assert httpx.get(router.http_url + "/health", timeout=10).status_code == 200
        finally:
            for s in idle:
                s.close()
        # nothing held afterwards: no admission slot, no body being read (fake workers hold no KV)
        wait_for(lambda: scrape_metrics(router.http_url).get("pdmesh:router_num_running_reqs", 1) == 0, 10,
                 "the router to hold no admission slot")


def test_a_worker_raises_its_soft_limit_and_warns_when_the_hard_one_is_low(tmp_path):
    with Launcher(log_dir=tmp_path) as mesh:
        prefill = mesh.start_prefill(prefix=("prlimit", "--nofile=256:2048"))
        assert soft_limit(prefill.popen.pid) == 2048
        assert "open-files limit low" in prefill.log() and "\"open_files_hard\": 2048" in prefill.log()
