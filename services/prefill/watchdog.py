"""Prefill's watchdog sweep: evict rooms older in their queue than that queue's deadline.

Queue <-> sender state (docs/architecture.md, "Queues, states and clocks"): bootstrap = Bootstrapping (decode has not attached),
inflight = Transferring (KV posted, not done). The waiting queue has no clock: a room there is
computing or about to. The clock is the time the room entered its current state, so a long
prefill never counts against the inflight deadline. The same tick drives the sender's own
sweep (parked attaches, deferred NIXL handles), so an idle worker does that work too.
"""

from __future__ import annotations

from services.common.watchdog_sweep import evict_expired
from services.transfer.state import RoomState

QUEUE_OF_STATE = {RoomState.BOOTSTRAPPING: "bootstrap", RoomState.TRANSFERRING: "inflight"}


def sweep(worker, bootstrap_timeout: float, inflight_timeout: float) -> int:
    deadlines = {RoomState.BOOTSTRAPPING: bootstrap_timeout, RoomState.TRANSFERRING: inflight_timeout}
    evicted = evict_expired(worker, worker.sender.rooms, QUEUE_OF_STATE, deadlines)
    # work that would otherwise move only under traffic (the poller sleeps when no transfer is
    # in flight): parked attaches expire, deferred NIXL handle releases are retried and logged
    worker.sender.sweep()
    return evicted
