"""Free 127.0.0.1 ports for the processes a test starts.

`bind(0)` hands out ports from the kernel's ephemeral range, which is also where every outgoing
connection and every UCX/NIXL listener of the workers takes its port. Between our bind-and-close
and the service's own bind, such a socket can take the port ("address already in use"). So the
ports come from below the ephemeral range instead, walked in order from a per-process random
start so that concurrent test runs and successive tests don't reuse one another's ports.

Under pytest-xdist each worker (PYTEST_XDIST_WORKER gwN of PYTEST_XDIST_WORKER_COUNT) walks its own
slice of that range, and so do the processes it starts (they inherit the variables): two test
files running side by side never take the same port, also when one of them gives a port back
for a moment (a worker killed and restarted on its address) and the other is looking for one.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading

_LOW, _HIGH = 20000, 32000  # below Linux's default ephemeral range (32768-60999)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range(low: int, high: int, environ: dict[str, str] | os._Environ = os.environ) -> tuple[int, int]:
    """[low, high), or this xdist worker's share of it."""
    worker, count = environ.get("PYTEST_XDIST_WORKER", ""), environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return low, high
    index, n = int(worker[2:]), int(count)
    size = (high - low) // n if n > 0 else 0
    if index >= n or size < 100:  # too narrow to share: the whole range, as without xdist
        return low, high
    return low + index * size, low + (index + 1) * size


_low, _high = port_range(_LOW, min(_HIGH, _ephemeral_low() - 1))
_start = random.Random(os.getpid()).randrange(_low, _high) if _high > _low else _low
_next = itertools.cycle([*range(_start, _high), *range(_low, _start)])
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    if _high <= _low:  # an unusual ephemeral range leaves no room below it: let the kernel choose
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    with _lock:
        for _ in range(_high - _low):
            port = next(_next)
            if _bindable(port):
                return port
    raise RuntimeError(f"no free port in {_low}-{_high}")
