"""The soak's invariant 6 (chaos/soak_conversations.cache_hits): quiet rounds from round 2
on, away from every fault and its settling time, must mostly report cached prompt tokens."""

from __future__ import annotations

from chaos.soak_conversations import SETTLE_S, cache_hits
from chaos.soak_load import Result


def round_(i: int, rnd: int, started: float, cached: int | None, cause: str = "") -> Result:
    return Result(id=i, client=-1, prompt=[65] * 100, max_tokens=24, temperature=0.0, seed=None, stream=False,
                  started=started, ended=started + 1.0, cause=cause, conversation=0, round=rnd, cached_tokens=cached)


FAULT = [{"began": 10.0, "ended": 20.0}]


def test_round_one_failures_and_rounds_near_a_fault_are_not_judged():
    results = [round_(0, 1, 0.0, 0),  # round 1: nothing to hit
               round_(1, 2, 2.0, 96), round_(2, 3, 4.0, 192),
               round_(3, 4, 9.5, 0),  # overlaps the fault's start
               round_(4, 4, 20.0 + SETTLE_S - 0.5, 0),  # settling after it
               round_(5, 5, 30.0, 0, cause="http_503:x"),  # failed
               round_(6, 5, 31.0, 400)]
    stats = cache_hits(results, FAULT, t0=0.0)
    assert (stats["quiet_rounds_from_2"], stats["quiet_hits"], stats["ok"]) == (3, 3, True)
    assert stats["rounds"] == 7 and stats["rounds_ok"] == 6 and stats["deepest_round"] == 5


def test_most_quiet_rounds_missing_fails_and_none_quiet_holds():
    results = [round_(i, 2 + i, 30.0 + 2 * i, 96 if i == 0 else 0) for i in range(3)]
    assert cache_hits(results, FAULT, t0=0.0)["ok"] is False
    assert cache_hits(results[:2], FAULT, t0=0.0)["ok"] is True  # one of two: the share is met
    assert cache_hits([], FAULT, t0=0.0)["ok"] is True
    assert cache_hits([round_(0, 3, 12.0, 0)], FAULT, t0=0.0)["quiet_hit_share"] is None
