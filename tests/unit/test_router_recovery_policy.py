"""recovery_policy: every (status, failure, budget) cell of the decision, and the classification."""

from __future__ import annotations

import itertools

import grpc
import pytest

from services.common.refusal import Refusal
from services.router.recovery_policy import RUNNING, Action, FailureKind, classify, decide, next_status
from services.router.request_state import TRANSITIONS, Status

BEFORE_A_TOKEN = (Status.PREFILLING, Status.MIGRATING)


def expected(status: Status, failure: FailureKind, failovers_left: int, migrations_left: int) -> Action:
    """The table of the module's docstring, written out cell by cell."""
    if failure in (FailureKind.REJECTED, FailureKind.DEADLINE):
        return Action.FAIL
    if status in BEFORE_A_TOKEN:
        if failure is FailureKind.CAPACITY:
            return Action.SKIP_WORKER
        return Action.FAIL_OVER if failovers_left else Action.FAIL
    return Action.MIGRATE if migrations_left else Action.FAIL  # streaming: capacity is a worker failure


CELLS = list(itertools.product(RUNNING, FailureKind, (0, 1, 3), (0, 1, 2)))


@pytest.mark.parametrize(("status", "failure", "failovers_left", "migrations_left"), CELLS)
def test_every_cell(status, failure, failovers_left, migrations_left):
    action = decide(status, failure, failovers_left, migrations_left)
    assert action is expected(status, failure, failovers_left, migrations_left)
    # the request's next status is always a legal transition from where it failed
    assert next_status(status, action) in TRANSITIONS[status]


def test_budget_is_never_spent_past_zero():
    assert decide(Status.PREFILLING, FailureKind.WORKER, 0, 5) is Action.FAIL
    assert decide(Status.STREAMING, FailureKind.WORKER, 5, 0) is Action.FAIL
    # a capacity refusal spends nothing, so it is skipped even with no budget left
    assert decide(Status.PREFILLING, FailureKind.CAPACITY, 0, 0) is Action.SKIP_WORKER


@pytest.mark.parametrize("status", [Status.ADMITTED, Status.FINISHED])
def test_no_decision_without_a_running_attempt(status):
    for failure in FailureKind:
        with pytest.raises(ValueError):
            decide(status, failure, 1, 1)


CODES = [None, *grpc.StatusCode]


@pytest.mark.parametrize(("code", "refusal", "at_deadline"),
                         list(itertools.product(CODES, Refusal, (False, True))),
                         ids=lambda v: getattr(v, "name", str(v)))
def test_classify_every_code_refusal_and_clock(code, refusal, at_deadline):
    kind = classify(code, refusal, at_deadline)
    if refusal in (Refusal.KV_CAPACITY, Refusal.TOO_LONG):
        assert kind is FailureKind.CAPACITY  # the worker's answer, by code, whatever the clock
    elif at_deadline:
        assert kind is FailureKind.DEADLINE
    elif code == grpc.StatusCode.INVALID_ARGUMENT or refusal is Refusal.INVALID:
        assert kind is FailureKind.REJECTED
    else:
        assert kind is FailureKind.WORKER  # draining, a duplicate room, any error: another pair may serve


def test_the_refusal_codes_are_the_protos():
    from services.common.generated.pdmesh.v1 import worker_pb2 as wpb

    assert {r.name: int(r) for r in Refusal} == {
        name.removeprefix("REFUSAL_REASON_"): value for name, value in wpb.RefusalReason.items()}
    assert Refusal.UNSPECIFIED == 0
