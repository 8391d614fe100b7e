"""What both ends of the KV transfer (KVSender, KVReceiver) keep alike: the NIXL agent and KV pool
they work with, their room table, the poller's wakeup, and how a room is failed and its owner
told.

No torch and no nixl import: the agent is passed in (services/transfer/nixl_agent.NixlAgent, or
a fake in unit tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic

from services.transfer.state import Clock, R, RoomState, RoomTable


class TransferSide(Generic[R]):
    logger: Any  # the side's own logger (transfer.sender, transfer.receiver)

    def __init__(self, agent, pool, clock: Clock = time.monotonic,
                 on_terminal: Callable[[R], None] | None = None, tombstones: int = 65536):
        self.agent = agent
        self.pool = pool
        self.clock = clock
        self.on_terminal = on_terminal  # the worker's: a room reached Success or Failed
        self.rooms: RoomTable[R] = RoomTable(clock, tombstones)
        self.wakeup: Callable[[], None] = lambda: None  # set by the poller

    @property
    def agent_name(self) -> str:
        return self.agent.name

    @property
    def epoch(self) -> int:
        return self.agent.epoch

    def fail(self, room: int, reason: str) -> bool:
        """Fail a room (watchdog, heartbeat, abort, worker errors). False when unknown or already
        terminal."""
        r = self.rooms.for_event(room)
        return r is not None and self._fail(r, reason)

    def _fail(self, r: R, reason: str) -> bool:
        raise NotImplementedError

    def _tell_owner(self, r: R) -> None:
        """The room is terminal: the worker's callback runs; its failure must not stop the side."""
        if self.on_terminal is not None:
            try:
                self.on_terminal(r)
            except Exception:
                self.logger.exception("on_terminal callback failed", room=r.room)

    def counts(self) -> dict[str, int]:
        return {s.label: self.rooms.count(s) for s in RoomState}
