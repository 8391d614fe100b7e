"""What a request does after an attempt failed: a pure function of (status, failure, budget).

`classify` turns a worker failure into one of four kinds; `decide` picks the action:

| failure  | prefilling / migrating (no token of this attempt yet) | streaming (tokens went out)   |
|----------|-------------------------------------------------------|-------------------------------|
| capacity | skip that worker, try the others (no budget spent)    | as `worker` (cannot happen)   |
| rejected | fail (400: the request itself is refused)             | fail                          |
| deadline | fail (504)                                            | fail                          |
| worker   | fail over to another pair while fail-overs are left   | migrate while migrations are  |
|          | (else fail)                                           | left (else fail)              |

A capacity refusal means that worker can never hold the request (its KV pool or its
--max-model-len is too small); other workers may, so it spends no budget — the orchestrator
answers 400 once every healthy worker of a role has refused. `worker` is anything else that went
wrong on the worker or its path (an error status, an ejection, a stall, a stream that ended
early, a draining worker): another pair may serve. No other state is read, so the table above
is the whole behaviour (tests/unit/test_router_recovery_policy.py walks every cell).
"""

from __future__ import annotations

import enum

import grpc

from services.common.refusal import Refusal
from services.router.request_state import Status


class FailureKind(enum.Enum):
    CAPACITY = "capacity"
    REJECTED = "rejected"
    DEADLINE = "deadline"
    WORKER = "worker"


class Action(enum.Enum):
    SKIP_WORKER = "skip_worker"
    FAIL_OVER = "fail_over"
    MIGRATE = "migrate"
    FAIL = "fail"


RUNNING = (Status.PREFILLING, Status.STREAMING, Status.MIGRATING)  # the statuses an attempt fails in


def classify(code: grpc.StatusCode | None, refusal: Refusal, at_deadline: bool) -> FailureKind:
    """The kind of a failed attempt: its gRPC status, the worker's refusal code (Refusal.UNSPECIFIED when
    it gave none) and whether the request's deadline is (about to be) past."""
    if refusal in (Refusal.KV_CAPACITY, Refusal.TOO_LONG):
        return FailureKind.CAPACITY  # checked first: a refusal is the worker's answer, whatever the clock
    if at_deadline:
        return FailureKind.DEADLINE
    if code == grpc.StatusCode.INVALID_ARGUMENT or refusal is Refusal.INVALID:
        return FailureKind.REJECTED
    return FailureKind.WORKER


def decide(status: Status, failure: FailureKind, failovers_left: int, migrations_left: int) -> Action:
    if status not in RUNNING:
        raise ValueError(f"no attempt runs while a request is {status.value}")
    if failure in (FailureKind.REJECTED, FailureKind.DEADLINE):
        return Action.FAIL
    if failure is FailureKind.CAPACITY and status is not Status.STREAMING:
        return Action.SKIP_WORKER
    if status is Status.STREAMING:
        return Action.MIGRATE if migrations_left > 0 else Action.FAIL
    return Action.FAIL_OVER if failovers_left > 0 else Action.FAIL


def next_status(status: Status, action: Action) -> Status:
    """Where the request goes for the next attempt (FAIL: it finishes)."""
    if action is Action.FAIL:
        return Status.FINISHED
    if action is Action.MIGRATE:
        return Status.MIGRATING
    return status  # a fail-over or a skipped worker: the same phase on another pair
