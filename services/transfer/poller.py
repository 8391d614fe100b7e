"""Drives NIXL progress from the worker's asyncio loop without spinning a core when idle.

NIXL runs without its progress thread (see nixl_agent.py), so someone must poll: while any
room needs it the task calls ``poll()`` every ``interval`` (asyncio's timer granularity makes
that ~1 ms); when ``poll()`` reports nothing in flight it sleeps on an event until ``kick()``
(called by the sender/receiver whenever a room starts needing progress).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

from services.common.logging_setup import get_logger

log = get_logger("transfer.poller")


class ProgressPoller:
    def __init__(self, poll: Callable[[], int], interval: float = 0.0005, name: str = "kv-progress"):
        self._poll = poll
        self.interval = interval
        self.name = name
        self._event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.polls = 0  # for tests: proves the loop idles when nothing is in flight
        self.errors = 0

    @classmethod
    def attach(cls, manager, interval: float = 0.0005) -> ProgressPoller:
        """Poller for a KVSender or KVReceiver: polls manager.poll, woken by manager.wakeup."""
        p = cls(manager.poll, interval, name=f"kv-progress-{type(manager).__name__}")
        manager.wakeup = p.kick
        return p

    def kick(self) -> None:
        self._event.set()

    def start(self, spawn: Callable[[Coroutine, str], asyncio.Task] | None = None) -> asyncio.Task:
        """Start polling. `spawn(coro, name)` creates the task (the worker's supervisor, which
        takes the worker down if polling ever stops); plain create_task without it."""
        if self._task is None or self._task.done():
            if spawn is not None:
                self._task = spawn(self._run(), "poller")
            else:
                self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            self._event.clear()  # a kick() during poll() re-sets it: no lost wake-up
            try:
                busy = self._poll()
            except Exception:
                self.errors += 1
                log.exception("poll failed", poller=self.name)
                busy = 1
            self.polls += 1
            if busy:
                await asyncio.sleep(self.interval)
            else:
                await self._event.wait()
