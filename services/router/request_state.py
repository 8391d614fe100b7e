"""One request (one choice of it) as the router runs it: one status, checked transitions.

`RequestState` owns what used to be spread over the orchestrator's locals: the spec, the
progress (prompt + ids generated so far, services/router/migration.py), the retry budget, the
workers to avoid, the timings and the room of its first attempt. `Orchestrator.generate` moves
it through one status enum:

    admitted ──> prefilling ──> streaming ──> finished
                  │  ↺ fail-over     │   ↑
                  │                  v   │ first token of the continuation
                  │               migrating ↺ fail-over (continuation not started yet)
                  └──────────────────────────> finished (from any state: done, error, client gone)

- admitted: slots taken, no attempt started yet (choosing a pair).
- prefilling: an attempt runs and decode has sent no token of it; a failure now can start over
  on another pair (fail-over, the self-loop), since the client has seen nothing.
- streaming: tokens flow; a decode failure now moves the request (migrating) instead.
- migrating: the request continues on another pair from prompt + generated ids; no token of the
  continuation yet (a failure now fails the continuation over, the self-loop).
- finished: nothing more happens; `finish_reason` or `error` says how it ended.

Any other transition is a bug and raises `IllegalTransition`. What to do after a failure is
services/router/recovery_policy.py's pure decision over (status, failure, budget).
Free of torch, NIXL and gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.router.migration import Progress

if TYPE_CHECKING:
    from services.router.pool import WorkerHandle
    from services.router.protocol import GenerateSpec


class Status(enum.Enum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    MIGRATING = "migrating"
    FINISHED = "finished"


# the self-loops of prefilling and migrating are fail-overs: the same phase on another pair
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.ADMITTED: frozenset({Status.PREFILLING, Status.FINISHED}),
    Status.PREFILLING: frozenset({Status.PREFILLING, Status.STREAMING, Status.FINISHED}),
    Status.STREAMING: frozenset({Status.MIGRATING, Status.FINISHED}),
    Status.MIGRATING: frozenset({Status.MIGRATING, Status.STREAMING, Status.FINISHED}),
    Status.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(slots=True)
class RetryBudget:
    """Attempts a request may still spend: fail-overs (before a token of the attempt) and
    migrations (after one). Capacity refusals spend nothing: they are bounded by the workers."""

    max_failovers: int
    max_migrations: int
    failovers: int = 0
    migrations: int = 0

    @property
    def failovers_left(self) -> int:
        return self.max_failovers - self.failovers

    @property
    def migrations_left(self) -> int:
        return self.max_migrations - self.migrations


@dataclass(slots=True)
class PrefillShare:
    """What the n choices of one request share on their first attempt (services/router/fanout.py)."""

    key: int  # PrefillRequest.share_key: non-zero, random per request
    prefill: WorkerHandle | None = None  # the prefill the first choice drew; the others ask for it


@dataclass(slots=True)
class Timings:
    """Event-loop times (loop.time()) of the request's steps; None: not reached."""

    admitted: float
    first_token: float | None = None
    last_attempt: float | None = None  # when the latest attempt started
    finished: float | None = None


@dataclass(eq=False, slots=True)
class RequestState:
    spec: GenerateSpec
    budget: RetryBudget
    timings: Timings
    first_room: int | None = None  # the first attempt's room (the request id); later ones get new rooms
    share: PrefillShare | None = None  # n > 1: the prefill its choices share on their first attempt
    status: Status = Status.ADMITTED
    progress: Progress = field(init=False)
    attempts: int = 0
    exclude: set = field(default_factory=set)  # workers the next attempt avoids
    refused: set = field(default_factory=set)  # workers that can never hold this request (capacity)
    failed_pairs: set = field(default_factory=set)  # (prefill, decode) pairs an attempt failed on
    repeats: int = 0  # attempts on a pair that already failed (when nothing else is healthy)
    last_error: Exception | None = None  # the client-facing error of the latest failed attempt
    finish_reason: str = ""
    error: str = ""

    def __post_init__(self) -> None:
        self.progress = Progress(list(self.spec.prompt_ids), self.spec.max_tokens)

    def to(self, status: Status) -> None:
        if status not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"request cannot go from {self.status.value} to {status.value}")
        self.status = status

    def attempt_started(self, now: float) -> None:
        """A new attempt runs: the first one begins prefilling; a fail-over or migration is already
        in its phase (the transition was made when the failure was decided)."""
        self.attempts += 1
        self.timings.last_attempt = now
        if self.status is Status.ADMITTED:
            self.to(Status.PREFILLING)
        elif self.status not in (Status.PREFILLING, Status.MIGRATING):
            raise IllegalTransition(f"an attempt cannot start while {self.status.value}")

    @property
    def sharing(self) -> bool:
        """This attempt goes to the choices' shared prefill (their first attempt only)."""
        return self.share is not None and self.attempts == 0

    def tokens(self, token_ids: list[int], now: float) -> None:
        """Decode sent tokens: the first of an attempt makes the request stream (again)."""
        if self.status is not Status.STREAMING:
            self.to(Status.STREAMING)
            if self.timings.first_token is None:
                self.timings.first_token = now
        self.progress.add(token_ids)

    def finish(self, now: float, finish_reason: str = "", error: str = "") -> None:
        if self.status is Status.FINISHED:
            return  # the end is recorded once: the first path that ends the request says how
        self.to(Status.FINISHED)
        self.timings.finished = now
        self.finish_reason, self.error = finish_reason, error
