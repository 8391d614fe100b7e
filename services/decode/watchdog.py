"""Decode's watchdog sweep: evict rooms older in their queue than that queue's deadline.

Queue <-> receiver state (docs/architecture.md, "Queues, states and clocks"): prealloc = Bootstrapping (waiting for pages or for the
attach), transfer phase 2 = Transferring (clock from prefill's forward-done signal). Phase 1
(WaitingForInput: prefill still computing) has no clock: the heartbeats bound it by prefill's
liveness, so a prefill of many minutes is never failed here. A colocated job has no receiver
room: it is bounded by --prealloc-timeout while it waits for pages (PREALLOC), and by
--forward-timeout while decode computes its prompt (PREFILLING).
"""

from __future__ import annotations

import time

from services.common.watchdog_sweep import evict_expired
from services.decode.jobs import Phase
from services.transfer.state import RoomState

QUEUE_OF_STATE = {RoomState.BOOTSTRAPPING: "prealloc", RoomState.TRANSFERRING: "transfer"}


def sweep(worker, prealloc_timeout: float, transfer_timeout: float) -> int:
    deadlines = {RoomState.BOOTSTRAPPING: prealloc_timeout, RoomState.TRANSFERRING: transfer_timeout}
    evicted = evict_expired(worker, worker.receiver.rooms, QUEUE_OF_STATE, deadlines)
    now = time.monotonic()
    waiting = [j for j in worker.jobs.values()
               if j.colocated and j.phase is Phase.PREALLOC and now - j.created_at > prealloc_timeout]
    for job in waiting:
        worker.evict(job.room, "prealloc", now - job.created_at, prealloc_timeout)
    return evicted + len(waiting)
