"""Worker selection policies as pure logic."""

from __future__ import annotations

import random
from collections import Counter

import grpc
import pytest

from services.router.orchestrator import WorkerFailure, retry_avoids
from services.router.policy import LeastLoaded, PowerOfTwo, RoundRobin, make_policy
from services.router.pool import WorkerHandle


def test_round_robin_cycles():
    rr = RoundRobin()
    assert [rr.choose(["a", "b", "c"], lambda w: 0) for _ in range(6)] == list("abcabc")


def test_least_loaded_picks_minimum_and_rotates_ties():
    ll = LeastLoaded()
    load = {"a": 3, "b": 1, "c": 1}
    picks = [ll.choose(["a", "b", "c"], load.__getitem__) for _ in range(4)]
    assert set(picks) == {"b", "c"} and picks.count("b") == 2


def test_power_of_two_never_picks_the_most_loaded_of_three():
    p2 = PowerOfTwo(random.Random(0))
    load = {"a": 0, "b": 5, "c": 9}
    picks = Counter(p2.choose(["a", "b", "c"], load.__getitem__) for _ in range(300))
    assert picks["c"] == 0 and picks["a"] > picks["b"] > 0


def test_power_of_two_single_candidate():
    assert PowerOfTwo().choose(["only"], lambda w: 0) == "only"


def test_make_policy():
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("power_of_two"), PowerOfTwo)
    with pytest.raises(ValueError):
        make_policy("random")


# --- what a retry avoids ------------------------------------------------------------------------------


def test_retry_avoids_prefill_only_when_prefill_reported_the_failure():
    p, d = WorkerHandle("prefill", "p:1"), WorkerHandle("decode", "d:1")
    # decode's stream broke: the prefill that served the attempt is not suspect, and avoiding it
    # would push the retry towards other prefills, one of which may be dead and not yet ejected
    assert retry_avoids(WorkerFailure(d, grpc.StatusCode.UNAVAILABLE, "connection reset"), p, d) == {d}
    # prefill failed the room: the KV transfer may have broken on decode's side, so both
    assert retry_avoids(WorkerFailure(p, grpc.StatusCode.UNAVAILABLE, "room 7: transfer failed"), p, d) == {p, d}


def test_a_kv_integrity_failure_suspects_both_sides():
    # decode reports the checksum mismatch, but prefill wrote the pages: a misrouted WRITE is
    # prefill's fault, corrupt memory decode's, and the router cannot tell them apart
    p, d = WorkerHandle("prefill", "p:1"), WorkerHandle("decode", "d:1")
    assert retry_avoids(WorkerFailure(d, grpc.StatusCode.DATA_LOSS, "room 7: KV checksum mismatch"), p, d) == {p, d}
    assert retry_avoids(WorkerFailure(d, grpc.StatusCode.DATA_LOSS, "KV checksum mismatch"), None, d) == {d}
