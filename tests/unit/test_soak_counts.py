"""The soak's invariant 5 (chaos/soak_verify.check_counts): each router generation counted
every request clients are sure it answered, and nothing beyond what they may have sent it."""

from __future__ import annotations

from chaos.soak_load import Result
from chaos.soak_verify import check_counts


def result(i: int, gen: tuple[int, int], ended: float, cause: str = "") -> Result:
    return Result(id=i, client=0, prompt=[1], max_tokens=1, temperature=0.0, seed=None, stream=False,
                  ended=ended, router_gen=gen, status=None if cause else 200, cause=cause)


def counts(n: int) -> dict[str, float]:
    return {"pdmesh:router_requests_total{status=200}": float(n)} if n else {}


def test_exact_counts_pass_and_an_extra_or_missing_one_fails():
    results = [result(i, (0, 0), ended=float(i)) for i in range(5)]
    assert check_counts(results, [counts(5)], []) == []
    assert check_counts(results, [counts(6)], []) != []
    assert check_counts(results, [counts(4)], []) != []


def test_a_request_answered_by_the_new_router_before_the_restart_was_recorded():
    """Stamped with the old generation at both ends, yet served (and counted) by the new router:
    it ended after the old router was killed, so either generation may have counted it."""
    killed = 100.0
    old = [result(i, (0, 0), ended=float(i)) for i in range(10)]
    late = result(10, (0, 0), ended=killed + 0.05)
    new = [result(11 + i, (1, 1), ended=killed + 1 + i) for i in range(3)]
    results = [*old, late, *new]
    assert check_counts(results, [counts(10), counts(4)], [killed]) == []  # the new router counted it
    assert check_counts(results, [counts(11), counts(3)], [killed]) == []  # the old one did
    assert check_counts(results, [counts(10), counts(5)], [killed]) != []  # one too many
    # one that ended well before the kill is the old generation's for sure
    assert check_counts(results, [counts(9), counts(5)], [killed]) != []
