"""Server-sent events and client-disconnect detection on raw ASGI.

uvicorn silently drops writes to a closed connection, so a stream would only notice a gone
client when it next wrote — and not at all while it waits for a slow or frozen worker. Both
the SSE response and the non-streaming path therefore watch `receive()` for
`http.disconnect` and cancel the work the moment the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.router.connection_guard import CONNECTION_EXTENSION, watch_disconnect
from services.router.json_codec import dumps

DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


def sse_event(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call only after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Awaitable, receive: Receive, scope: dict | None = None):
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    `work` runs in the calling task, which is cancelled when the disconnect arrives: on the
    router's own server (`scope` given) by the connection's callback
    (connection_guard.watch_disconnect), elsewhere by a watcher task waiting on `receive()`. No
    task of its own for the work, and on the router's server none for the watch either (the
    router's hot path)."""
    task = asyncio.current_task()
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    unwatch = None if scope is None else watch_disconnect(scope, on_gone)
    watcher = None
    if unwatch is None:
        async def watch() -> None:
            await wait_disconnect(receive)
            on_gone()

        watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    except asyncio.CancelledError:
        if not gone:
            raise  # we ourselves were cancelled
        task.uncancel()  # the cancel was the watch's: it ends here, as ClientDisconnected
        raise ClientDisconnected() from None
    finally:
        if watcher is not None:
            watcher.cancel()
        else:
            unwatch()
    if gone:  # the work finished in spite of the cancel: the client is gone all the same
        task.uncancel()
        raise ClientDisconnected()
    return result


class SSEResponse(Response):
    """Streams `events` (already-encoded SSE bytes) and stops them when the client disconnects.

    `on_close(disconnected)` is awaited exactly once, after the stream ended or was cancelled,
    and after `events` was closed explicitly (aclose), started or not. `cut_off()` ends the
    stream as if the client had left (a client that falls too far behind): the connection is
    aborted where the server offers it (services/router/connection_guard.py) and the stream's
    task stops at once, whatever write it is blocked in.
    """

    media_type = "text/event-stream"
    charset = "utf-8"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[bool], Awaitable[None]],
        bind: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        headers: dict[str, str] | None = None,
    ):
        # Not Response.__init__: that would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.events = events
        self.on_close = on_close
        self.bind = bind  # context (e.g. log fields) for everything the stream runs
        self._task: asyncio.Task | None = None
        self._connection = None
        self._cut = False

    def cut_off(self) -> None:
        if self._cut:
            return
        self._cut = True
        if self._task is not None:  # else the stream has not started: it will not
            if self._connection is not None:
                self._connection.abort()
            self._task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        self._task = asyncio.current_task()
        self._connection = scope.get("extensions", {}).get(CONNECTION_EXTENSION)
        if self._cut:  # cut off before it began
            self._cut = False
            self.cut_off()

        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.events:
                # the events that end with [DONE] are the stream's last: the body's end goes out
                # in the same write (an event's JSON escapes newlines, so no other can end so)
                last = data.endswith(DONE)
                await send({"type": "http.response.body", "body": data, "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        with self.bind():
            try:
                await run_until_disconnect(pump(), receive, scope)
            except (ClientDisconnected, OSError):
                disconnected = True
            except asyncio.CancelledError:
                if not self._cut:
                    raise
                self._task.uncancel()
                disconnected = True
            finally:
                try:
                    with contextlib.suppress(Exception):
                        await self.events.aclose()  # type: ignore[attr-defined]
                finally:  # also when the closing is cancelled: on_close frees what the stream holds
                    await self.on_close(disconnected)
