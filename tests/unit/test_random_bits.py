"""services/common/random_bits.py: 63-bit numbers from blocks of the OS source, none shared with
a forked child."""

import os
import threading

from services.common import random_bits
from services.common.random_bits import randbits63


def test_numbers_are_63_bit_and_distinct_across_refills():
    got = [randbits63() for _ in range(3 * 512 + 7)]  # more than three blocks
    assert all(0 <= x < 1 << 63 for x in got)
    assert len(set(got)) == len(got)
    assert max(got).bit_length() >= 60  # the top bits are used, not only the low ones


def test_a_forked_child_draws_numbers_the_parent_does_not():
    randbits63()  # a block is loaded, with numbers left in it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the numbers it would share with its parent if it kept the block
        try:
            os.write(w, b",".join(b"%d" % randbits63() for _ in range(8)))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child = {int(x) for x in f.read().split(b",")}
    os.waitpid(pid, 0)
    parent = {randbits63() for _ in range(8)}
    assert len(child) == 8 and not child & parent


def test_the_block_is_read_once_per_512_numbers(monkeypatch):
    reads = []
    real = os.urandom
    monkeypatch.setattr(random_bits.os, "urandom", lambda n: reads.append(n) or real(n))
    random_bits._drop()
    for _ in range(1024):
        randbits63()
    assert reads == [4096, 4096]


def test_a_draw_that_refills_lets_no_other_draw_run_meanwhile(monkeypatch):
    # the refill is the one place a draw can stop mid-way: another thread drawing then would read
    # the same offset (a number twice) or have its block thrown away under it
    blocks = iter([bytes(range(256)) * 16, bytes(range(256)) * 16])  # the same numbers if drawn twice
    other_done = threading.Event()
    other: list[int] = []

    def slow_urandom(n: int) -> bytes:
        if not other_done.is_set() and threading.current_thread() is threading.main_thread():
            worker = threading.Thread(target=lambda: (other.append(randbits63()), other_done.set()))
            worker.start()
            assert not other_done.wait(0.3), "another draw ran while this one was refilling"
        return next(blocks)

    monkeypatch.setattr(random_bits, "_buffer", b"")
    monkeypatch.setattr(random_bits, "_offset", 4096)
    monkeypatch.setattr(random_bits.os, "urandom", slow_urandom)
    first = randbits63()
    assert other_done.wait(5)
    assert first != other[0]
