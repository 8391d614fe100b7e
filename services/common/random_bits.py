"""Random 63-bit numbers (room ids, a request's default seed) from the OS's random source, read
in blocks.

The router draws two per request; `secrets.randbits` reads the OS source once per number (a
`getrandom` call and its Python wrapping each time), a measurable part of a request at a few
thousand requests/s. These come from the same source, 4 KiB at a time, so they stay as
unpredictable as `secrets`' (a room id is also the default id a client sees). A forked child
drops the block it inherited, so no two processes hand out the same numbers.
"""

from __future__ import annotations

import os
import random
import threading

_BLOCK = 4096  # bytes read from the OS per refill: 512 numbers

_buffer = b""
_offset = _BLOCK
# a big body's seed is drawn on a worker thread (request_body.parse_spec): no number twice
_lock = threading.Lock()


def _drop() -> None:
    global _buffer, _offset, _lock
    _buffer, _offset, _lock = b"", _BLOCK, threading.Lock()  # a fresh lock: another thread may hold ours


os.register_at_fork(after_in_child=_drop)


class SeededBits:
    """Random 63-bit numbers from a generator seeded with `seed` (the router's --seed): the same
    seed gives the same sequence, so requests without a seed of their own sample the same text
    when the same requests come in the same order. Thread-safe, as randbits63."""

    def __init__(self, seed: int):
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._random.getrandbits(63)


def randbits63() -> int:
    """A uniformly random integer in [0, 2**63)."""
    global _buffer, _offset
    with _lock:
        at = _offset
        if at >= _BLOCK:
            _buffer, at = os.urandom(_BLOCK), 0
        _offset = at + 8
        return int.from_bytes(_buffer[at:at + 8], "little") >> 1
