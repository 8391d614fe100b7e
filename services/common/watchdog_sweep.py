"""The part of both workers' watchdog sweeps that reads a transfer side's room table: each
role's own sweep (services/prefill/watchdog.py, services/decode/watchdog.py) names which room
states are queues with a deadline."""

from __future__ import annotations

from services.transfer.state import RoomState, RoomTable


def evict_expired(worker, rooms: RoomTable, queue_of_state: dict[RoomState, str],
                  deadlines: dict[RoomState, float]) -> int:
    """Evict (`worker.evict`) every room older in its state than that state's deadline, from the
    queue the state stands for; returns how many."""
    expired = rooms.expired(deadlines)
    for e in expired:
        worker.evict(e.room, queue_of_state[e.state], e.age, deadlines[e.state])
    return len(expired)
