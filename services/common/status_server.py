"""Serve an ASGI app (Starlette) with uvicorn on the caller's own asyncio loop.

The workers answer scrapes and probes (/metrics, /health) with the same well-kept HTTP stack
as the router, instead of a hand-written HTTP/1.1 parser. uvicorn runs as a task on the
worker's loop (no thread, no second loop), with its own signal handling switched off: the
worker's SIGTERM/SIGINT handlers (services/common/process.py) keep deciding when to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine

import uvicorn

STARTUP_TIMEOUT = 10.0


class _LoopServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the worker owns the process's signals
        yield


class StatusServer:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task):
        self._server, self.task = server, task

    async def stop(self) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=5)
        except (TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
            self.task.cancel()


async def start_status_server(
    app, host: str, port: int, spawn: Callable[[Coroutine, str], asyncio.Task] | None = None, name: str = "http"
) -> StatusServer:
    """Start serving `app`; returns once the socket is bound (raises OSError if it cannot be)."""
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30
    )
    server = _LoopServer(config)
    coro = server.serve()
    task = spawn(coro, name) if spawn else asyncio.get_running_loop().create_task(coro, name=name)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT
    while not server.started:
        if task.done():  # uvicorn exits (SystemExit) when it cannot bind
            raise OSError(f"cannot serve HTTP on {host}:{port} (in use?)")
        if loop.time() > deadline:
            task.cancel()
            raise OSError(f"HTTP server on {host}:{port} did not start within {STARTUP_TIMEOUT:g}s")
        await asyncio.sleep(0.01)
    return StatusServer(server, task)
