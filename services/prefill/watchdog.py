"""Prefill's watchdog sweep: evict rooms older in their queue than that queue's deadline.

Queue <-> sender state (DESIGN.md §3): bootstrap = Bootstrapping (decode has not attached),
inflight = Transferring (KV posted, not done). The waiting queue has no clock: a room there is
computing or about to. The clock is the time the room entered its current state, so a long
prefill never counts against the inflight deadline.
"""

from __future__ import annotations

from services.transfer.state import RoomState

QUEUE_OF_STATE = {RoomState.BOOTSTRAPPING: "bootstrap", RoomState.TRANSFERRING: "inflight"}


def sweep(worker, bootstrap_timeout: float, inflight_timeout: float) -> int:
    deadlines = {RoomState.BOOTSTRAPPING: bootstrap_timeout, RoomState.TRANSFERRING: inflight_timeout}
    expired = worker.sender.rooms.expired(deadlines)
    for e in expired:
        worker.evict(e.room, QUEUE_OF_STATE[e.state], e.age, deadlines[e.state])
    return len(expired)
