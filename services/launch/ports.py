"""Free 127.0.0.1 ports for the processes a test starts.

`bind(0)` hands out ports from the kernel's ephemeral range, which is also where every outgoing
connection and every UCX/NIXL listener of the workers takes its port. Between our bind-and-close
and the service's own bind, such a socket can take the port ("address already in use"). So the
ports come from below the ephemeral range instead, walked in order from a per-process random
start so that concurrent test runs and successive tests don't reuse one another's ports.
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


_high = min(_HIGH, _ephemeral_low() - 1)
_start = random.Random(os.getpid()).randrange(_LOW, _high) if _high > _LOW else _LOW
_next = itertools.cycle([*range(_start, _high), *range(_LOW, _start)])
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    if _high <= _LOW:  # an unusual ephemeral range leaves no room below it: let the kernel choose
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    with _lock:
        for _ in range(_high - _LOW):
            port = next(_next)
            if _bindable(port):
                return port
    raise RuntimeError(f"no free port in {_LOW}-{_high}")
