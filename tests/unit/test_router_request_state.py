"""The request object's one status: every transition either allowed by the table or refused."""

from __future__ import annotations

import itertools

import pytest

from services.router.request_state import (
    TRANSITIONS,
    IllegalTransition,
    PrefillShare,
    RequestState,
    RetryBudget,
    Status,
    Timings,
)

ALLOWED = {
    (Status.ADMITTED, Status.PREFILLING), (Status.ADMITTED, Status.FINISHED),
    (Status.PREFILLING, Status.PREFILLING), (Status.PREFILLING, Status.STREAMING),
    (Status.PREFILLING, Status.FINISHED),
    (Status.STREAMING, Status.MIGRATING), (Status.STREAMING, Status.FINISHED),
    (Status.MIGRATING, Status.MIGRATING), (Status.MIGRATING, Status.STREAMING),
    (Status.MIGRATING, Status.FINISHED),
}


class Spec:  # the two fields RequestState reads of a GenerateSpec
    prompt_ids = [1, 2, 3]
    max_tokens = 5


def request(status: Status = Status.ADMITTED, share: PrefillShare | None = None) -> RequestState:
    req = RequestState(Spec(), RetryBudget(3, 2), Timings(0.0), first_room=7, share=share)
    req.status = status
    return req


def test_the_table_is_the_documented_lifecycle():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


@pytest.mark.parametrize(("start", "target"), list(itertools.product(Status, Status)),
                         ids=lambda s: s.value)
def test_every_transition_is_allowed_or_raises(start, target):
    req = request(start)
    if (start, target) in ALLOWED:
        req.to(target)
        assert req.status is target
    else:
        with pytest.raises(IllegalTransition):
            req.to(target)
        assert req.status is start


def test_a_request_that_streams_migrates_and_finishes():
    req = request(share=PrefillShare(key=9))
    assert req.sharing  # its first attempt goes to the shared prefill
    req.attempt_started(1.0)
    assert req.status is Status.PREFILLING and req.attempts == 1 and not req.sharing
    req.tokens([10, 11], 2.0)
    assert req.status is Status.STREAMING and req.timings.first_token == 2.0
    req.to(Status.MIGRATING)
    req.attempt_started(3.0)  # the continuation: prompt + the two ids generated
    assert req.progress.ids() == [1, 2, 3, 10, 11] and req.progress.remaining == 3
    req.tokens([12], 4.0)
    assert req.status is Status.STREAMING and req.timings.first_token == 2.0  # the request's first, kept
    req.finish(5.0, "length")
    req.finish(6.0, error="a later path ends it again")  # the first end is the one recorded
    assert (req.status, req.finish_reason, req.error, req.timings.finished) == (Status.FINISHED, "length", "", 5.0)


def test_an_attempt_cannot_start_while_streaming_or_finished():
    for status in (Status.STREAMING, Status.FINISHED):
        with pytest.raises(IllegalTransition):
            request(status).attempt_started(0.0)


def test_a_finished_request_takes_no_tokens():
    req = request(Status.FINISHED)
    with pytest.raises(IllegalTransition):
        req.tokens([1], 0.0)


def test_the_budget_counts_down():
    budget = RetryBudget(max_failovers=3, max_migrations=0)
    assert (budget.failovers_left, budget.migrations_left) == (3, 0)
    budget.failovers += 1
    assert budget.failovers_left == 2
