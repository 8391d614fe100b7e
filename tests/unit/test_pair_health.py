"""Pair health (services/router/pair_health.py) and how the pool routes around marked pairs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.router.pair_health import PairHealth, pair_failure
from services.router.pool import WorkerHandle, WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_mark_lasts_until_cleared_forgotten_or_held_out():
    clock = Clock()
    h = PairHealth(hold=30, clock=clock)
    assert h.mark("p0", "d0", "attach refused") is True
    assert h.mark("p0", "d0", "again") is False  # renewed, not new
    assert h.is_marked("p0", "d0") and not h.is_marked("p0", "d1") and not h.is_marked("p1", "d0")
    assert h.marks()[("p0", "d0")].failures == 2
    clock.now += 29
    h.mark("p0", "d0", "still failing")  # a renewal restarts the hold
    clock.now += 29
    assert h.is_marked("p0", "d0")
    clock.now += 1.5
    assert not h.is_marked("p0", "d0") and h.marks() == {}
    h.mark("p0", "d0", "x")
    assert h.clear("p0", "d0") is True and h.clear("p0", "d0") is False
    h.mark("p0", "d0", "x")
    h.mark("p1", "d0", "x")
    h.mark("p1", "d1", "x")
    h.forget("d0")
    assert set(h.marks()) == {("p1", "d1")}


def test_hold_zero_keeps_a_mark_until_something_clears_it():
    clock = Clock()
    h = PairHealth(hold=0, clock=clock)
    h.mark("p", "d", "x")
    clock.now += 1e6
    assert h.is_marked("p", "d")


def test_idle_time_counts_from_the_last_use():
    clock = Clock()
    h = PairHealth(clock=clock)
    assert h.idle_for("p", "d", since=90.0) == 10.0
    h.touch("p", "d")
    clock.now += 3
    assert h.idle_for("p", "d", since=0.0) == 3.0
    h.forget("p")
    assert h.idle_for("p", "d", since=50.0) == 53.0


@pytest.mark.parametrize(("code", "kind", "produced", "at_deadline", "expected"), [
    (grpc.StatusCode.UNAVAILABLE, "error", False, False, True),  # attach refused / peer unreachable
    (grpc.StatusCode.DEADLINE_EXCEEDED, "error", False, False, True),  # a transfer that timed out
    (grpc.StatusCode.FAILED_PRECONDITION, "error", False, False, True),  # layouts or versions disagree
    (grpc.StatusCode.DATA_LOSS, "error", False, False, True),  # KV that arrived wrong
    (grpc.StatusCode.UNAVAILABLE, "error", True, False, False),  # after the first token: decode's own
    (grpc.StatusCode.DEADLINE_EXCEEDED, "error", False, True, False),  # the request's own deadline
    (grpc.StatusCode.INVALID_ARGUMENT, "error", False, False, False),
    (grpc.StatusCode.CANCELLED, "error", False, False, False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "error", False, False, False),
    (None, "stalled", False, False, False),  # a silent decode: the worker's problem
    (None, "ejected", False, False, False),
])
def test_which_failures_count_against_the_pair(code, kind, produced, at_deadline, expected):
    assert pair_failure(code, kind, produced, at_deadline) is expected


def pool_of(prefills: int, decodes: int, policy: str = "round_robin") -> WorkerPool:
    pool = WorkerPool([], [], policy=policy, lane=False)
    pool.prefills = [WorkerHandle("prefill", f"p{i}:1", healthy=True) for i in range(prefills)]
    pool.decodes = [WorkerHandle("decode", f"d{i}:1", healthy=True) for i in range(decodes)]
    return pool


def choose(pool: WorkerPool, n: int) -> list[tuple[str, str]]:
    async def run():
        out = []
        for _ in range(n):
            pair = await pool.choose_pair()
            pair.release()
            p, d = pair
            out.append((p.addr, d.addr))
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_routing_avoids_a_marked_pair_and_keeps_both_workers_busy(policy):
    pool = pool_of(2, 2, policy)
    p0, p1 = pool.prefills
    d0, d1 = pool.decodes
    pool.pairs.mark(p0, d0, "attach refused")
    pairs = choose(pool, 40)
    assert ("p0:1", "d0:1") not in pairs
    for worker in ("p0:1", "p1:1", "d0:1", "d1:1"):  # every worker keeps its share of the requests
        assert sum(worker in pair for pair in pairs) == 20, (worker, pairs)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_under_load_both_workers_of_a_marked_pair_serve_through_their_other_peers(policy):
    """Four requests in flight at a time: the decode whose only good pair is with the other
    prefill still gets its share (the pair's prefill is not chosen apart from it, in step with
    the other policy's tie cursor, which starved it)."""
    pool = pool_of(2, 2, policy)
    p0, p1 = pool.prefills
    d0, d1 = pool.decodes
    pool.pairs.mark(p0, d0, "partitioned")

    async def run():
        out = []
        for _ in range(10):
            held = [await pool.choose_pair() for _ in range(4)]
            out += [(p.addr, d.addr) for p, d in held]
            for pair in held:
                pair.release()
        return out

    pairs = asyncio.run(run())
    assert ("p0:1", "d0:1") not in pairs
    for worker in ("p0:1", "p1:1", "d0:1", "d1:1"):
        assert sum(worker in pair for pair in pairs) >= 10, (worker, pairs)


def test_a_prefill_whose_every_pair_is_marked_is_passed_over():
    pool = pool_of(2, 2)
    p0 = pool.prefills[0]
    for d in pool.decodes:
        pool.pairs.mark(p0, d, "partitioned")
    assert {p for p, _ in choose(pool, 20)} == {"p1:1"}


def test_marks_steer_but_never_refuse():
    pool = pool_of(1, 1)
    pool.pairs.mark(pool.prefills[0], pool.decodes[0], "x")
    assert choose(pool, 3) == [("p0:1", "d0:1")] * 3


def test_an_ejection_or_readmission_forgets_the_workers_pairs():
    pool = pool_of(2, 2)
    p0 = pool.prefills[0]
    pool.pairs.mark(p0, pool.decodes[0], "x")
    pool.pairs.mark(pool.prefills[1], pool.decodes[1], "x")
    pool._mark(p0, False, "probe failed")
    assert set(pool.pairs.marks()) == {(pool.prefills[1], pool.decodes[1])}
    pool.pairs.mark(p0, pool.decodes[1], "x")
    pool._mark(p0, True, "probe succeeded")
    assert set(pool.pairs.marks()) == {(pool.prefills[1], pool.decodes[1])}


def test_a_request_avoids_the_pairs_it_failed_on_when_every_worker_is_excluded():
    # 2x2 with one bad prefill and one bad decode: after failing on (p0, d1) and (p1, d0) the
    # request has excluded all four workers, and concurrent successes cleared the pool's marks;
    # its own failed pairs still steer every retry to the two pairs it has not tried
    pool = pool_of(2, 2)
    p0, p1 = pool.prefills
    d0, d1 = pool.decodes
    failed = {(p0, d1), (p1, d0)}

    async def run():
        out = set()
        for _ in range(20):
            pair = await pool.choose_pair(exclude={p0, p1, d0, d1}, avoid_pairs=failed)
            pair.release()
            out.add(tuple(pair))
        return out

    assert asyncio.run(run()) == {(p0, d0), (p1, d1)}
