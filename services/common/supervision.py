"""Supervision of a worker's long-lived tasks, and the worker's serving state.

A worker is a handful of asyncio tasks that must run forever (scheduler loops, the KV progress
poller, the watchdog, heartbeats, the HTTP server). If one of them ends — an exception, or a
plain return — the rooms it drives lose their clock while gRPC health would still say SERVING.
So any such end is fatal: health turns NOT_SERVING (gRPC and /health), one structured error is
logged, and the process exits with EXIT_TASK_ENDED so compose / Kubernetes restart it. The exit
is os._exit: a hung engine thread (a non-daemon executor thread) would otherwise block the
interpreter's exit forever.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from grpc_health.v1 import health

from services.common.grpc_server import set_not_serving, set_serving
from services.common.logging_setup import get_logger

EXIT_TASK_ENDED = 70  # EX_SOFTWARE: an internal task ended; restart me
CRASH_AFTER = 0.5  # crash_task fault: seconds after start
EXIT_GRACE = 1.0  # NOT_SERVING is visible this long before the process goes (a probe every second sees it)


class ServingState:
    """Whether the worker serves, shared by gRPC health and /health. Problems are keyed, so
    one that clears (a stuck forward that returned) does not clear another."""

    def __init__(self, servicer: health.aio.HealthServicer, services: tuple[str, ...]):
        self._servicer = servicer
        self._services = services
        self.problems: dict[str, str] = {}
        self.started = False

    @property
    def serving(self) -> bool:
        return self.started and not self.problems

    async def start(self) -> None:
        self.started = True
        await self._publish()

    async def problem(self, key: str, reason: str) -> None:
        self.problems[key] = reason
        await self._publish()

    async def clear(self, key: str) -> None:
        if self.problems.pop(key, None) is not None:
            await self._publish()

    async def _publish(self) -> None:
        if self.serving:
            await set_serving(self._servicer, *self._services)
        else:
            await set_not_serving(self._servicer, *self._services)


class Supervisor:
    """Starts the long-lived tasks and takes the worker down when one ends while it runs."""

    def __init__(self, role: str, state: ServingState, crash_task: str = "", exit_fn: Callable[[int], Any] = os._exit):
        self.log = get_logger(role)
        self.state = state
        self.crash_task = crash_task
        self.exit_fn = exit_fn
        self.stopping = False
        self.tasks: dict[str, asyncio.Task] = {}
        self.fatal: asyncio.Task | None = None

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        if name == self.crash_task:
            coro = _crash_later(coro, name)
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks[name] = task
        task.add_done_callback(self._ended)
        return task

    def watch(self, task: asyncio.Task, name: str) -> None:
        """Supervise a task started before the supervisor (the HTTP side, serving while the model
        loads); unlike spawned ones, stop() leaves it running for its owner to stop last."""
        task.add_done_callback(self._ended)
        if name == self.crash_task:
            self.spawn(asyncio.Event().wait(), name)  # spawn makes it crash

    def start(self, name: str, fn: Callable[[], Awaitable[None]]) -> asyncio.Task:
        return self.spawn(fn(), name)  # type: ignore[arg-type]

    def _ended(self, task: asyncio.Task) -> None:
        if self.stopping or self.fatal is not None:
            return
        error = None if task.cancelled() else task.exception()
        self.fatal = asyncio.get_running_loop().create_task(self._die(task.get_name(), task.cancelled(), error))

    async def _die(self, name: str, cancelled: bool, error: BaseException | None) -> None:
        how = "was cancelled" if cancelled else ("raised" if error else "returned")
        try:
            await self.state.problem("task", f"task {name} {how}")
        finally:
            self.log.error(
                "long-lived task ended: NOT_SERVING, exiting for a restart",
                task=name,
                how=how,
                error=repr(error) if error else None,
                exit_code=EXIT_TASK_ENDED,
                exc_info=error,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            await asyncio.sleep(EXIT_GRACE)
            self.exit_fn(EXIT_TASK_ENDED)

    async def stop(self) -> None:
        """Graceful stop: ending tasks is expected from here on."""
        self.stopping = True
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def _crash_later(coro: Coroutine, name: str) -> None:
    """crash_task fault: run the task, and raise in its place CRASH_AFTER seconds after start."""
    inner = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({inner}, timeout=CRASH_AFTER)
        if inner in done:
            return inner.result()
        raise RuntimeError(f"fault injection: crash_task={name}")
    finally:
        inner.cancel()
