"""Room state machines of the KV transfer, shared by the sender (prefill) and the receiver (decode).

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\________________\\_______________\\________-> Failed

- Transitions only move forward (skipping a state is allowed, going back never is).
- Failed wins: it is reachable from every non-terminal state; nothing leaves a terminal state.
- An event for a room the table does not hold (never created, or already removed) is dropped
  and counted; it never recreates the room.
- Every room records the monotonic time it entered its current state. The workers map states
  to their queues (docs/architecture.md), so this is the queue-entry time the watchdog measures from.

What each state means on each side:

| state            | sender (prefill)                         | receiver (decode)                           |
|------------------|------------------------------------------|---------------------------------------------|
| Bootstrapping    | waiting for decode's Attach (bootstrap q) | waiting for pages / attaching (prealloc q)  |
| WaitingForInput  | attached, forward pending (waiting q)    | attached, prefill computing (transfer ph. 1)|
| Transferring     | WRITE posted (inflight q)                | prefill said "forward done" (transfer ph. 2)|
| Success          | WRITE done, remote notified              | notification + verified aux row arrived     |
| Failed           | error, abort, timeout or peer gone       | same, or wrong aux row                      |

Pure Python: no torch, no nixl, injectable clock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, TypeVar

Clock = Callable[[], float]


class RoomState(IntEnum):
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5

    @property
    def terminal(self) -> bool:
        return self >= RoomState.SUCCESS

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    RoomState.BOOTSTRAPPING: "Bootstrapping",
    RoomState.WAITING_FOR_INPUT: "WaitingForInput",
    RoomState.TRANSFERRING: "Transferring",
    RoomState.SUCCESS: "Success",
    RoomState.FAILED: "Failed",
}


class DuplicateRoom(ValueError):
    """A room id that is live, or was used recently (tombstoned), was created again."""


@dataclass(eq=False)
class Room:
    """One room's transfer state. Subclasses (sender/receiver) add their own fields."""

    room: int
    created_at: float
    state: RoomState = RoomState.BOOTSTRAPPING
    state_since: float = 0.0
    reason: str | None = None  # why it failed
    history: list[tuple[RoomState, float]] = field(default_factory=list)

    def __post_init__(self):
        if not self.state_since:
            self.state_since = self.created_at
        if not self.history:
            self.history.append((self.state, self.state_since))

    def advance(self, new: RoomState, now: float) -> bool:
        """Move forward to a non-failed state; False (and no change) otherwise."""
        if new == RoomState.FAILED:
            raise ValueError("use fail() to fail a room")
        if self.state.terminal or new <= self.state:
            return False
        self._enter(new, now)
        return True

    def fail(self, reason: str, now: float) -> bool:
        """Failed wins over every non-terminal state; False when already terminal."""
        if self.state.terminal:
            return False
        self.reason = reason
        self._enter(RoomState.FAILED, now)
        return True

    def _enter(self, new: RoomState, now: float) -> None:
        self.state = new
        self.state_since = now
        self.history.append((new, now))

    def age(self, now: float) -> float:
        """Seconds in the current state (= in the current queue)."""
        return now - self.state_since


R = TypeVar("R", bound=Room)


@dataclass(frozen=True)
class Expired:
    room: int
    state: RoomState
    age: float


class RoomTable(Generic[R]):
    """Live rooms by id plus a bounded memory of finished ones (tombstones).

    Tombstones let late events be told apart from early ones and stop a finished room from
    being created again; they keep the final state (the heartbeat reports Success rooms as
    still held so decode waits for the notification instead of failing)."""

    def __init__(self, clock: Clock = time.monotonic, tombstones: int = 65536):
        self.clock = clock
        self._live: dict[int, R] = {}
        self._tomb: OrderedDict[int, RoomState] = OrderedDict()
        self._tomb_cap = tombstones
        self.dropped_events = 0

    # --- membership ------------------------------------------------------------------------
    def add(self, room: R) -> R:
        if room.room in self._live:
            raise DuplicateRoom(f"room {room.room} is already live")
        if room.room in self._tomb:
            raise DuplicateRoom(
                f"room {room.room} already finished ({self._tomb[room.room].label}); room ids are single-use"
            )
        self._live[room.room] = room
        return room

    def get(self, room: int) -> R | None:
        return self._live.get(room)

    def __contains__(self, room: int) -> bool:
        return room in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[R]:
        return iter(list(self._live.values()))

    def outcome(self, room: int) -> RoomState | None:
        """State of a live room, else the final state of a removed one, else None."""
        r = self._live.get(room)
        if r is not None:
            return r.state
        return self._tomb.get(room)

    def is_known(self, room: int) -> bool:
        return room in self._live or room in self._tomb

    def tombstone(self, room: int, state: RoomState) -> None:
        """Remember a room id as used without it ever having been live (e.g. aborted early)."""
        if room not in self._live:
            self._remember(room, state)

    def remove(self, room: int) -> R | None:
        """Drop a room from the table (fails it first if still non-terminal)."""
        r = self._live.pop(room, None)
        if r is None:
            return None
        if not r.state.terminal:
            r.fail("removed while in flight", self.clock())
        self._remember(room, r.state)
        return r

    def _remember(self, room: int, state: RoomState) -> None:
        self._tomb[room] = state
        self._tomb.move_to_end(room)
        while len(self._tomb) > self._tomb_cap:
            self._tomb.popitem(last=False)

    # --- events ----------------------------------------------------------------------------
    def for_event(self, room: int, *, open_only: bool = False) -> R | None:
        """The live room an event names; None, counted as a dropped event, when there is none
        (`open_only`: or when the room is already terminal, so the event comes late)."""
        r = self._live.get(room)
        if r is None or (open_only and r.state.terminal):
            self.dropped_events += 1
            return None
        return r

    def advance(self, room: int, new: RoomState) -> bool:
        r = self.for_event(room)
        return r is not None and r.advance(new, self.clock())

    def fail(self, room: int, reason: str) -> bool:
        r = self.for_event(room)
        return r is not None and r.fail(reason, self.clock())

    # --- queries ---------------------------------------------------------------------------
    def in_state(self, *states: RoomState) -> list[R]:
        return [r for r in self._live.values() if r.state in states]

    def count(self, state: RoomState) -> int:
        return sum(1 for r in self._live.values() if r.state == state)

    def expired(self, deadlines: dict[RoomState, float], now: float | None = None) -> list[Expired]:
        """Non-terminal rooms older in their state than that state's deadline (watchdog input).
        States without an entry (or with None) have no deadline."""
        now = self.clock() if now is None else now
        out = []
        for r in self._live.values():
            if r.state.terminal:
                continue
            limit = deadlines.get(r.state)
            if limit is not None and r.age(now) > limit:
                out.append(Expired(r.room, r.state, r.age(now)))
        return out
