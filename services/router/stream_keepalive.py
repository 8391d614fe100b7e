"""Keep-alive comments on a started stream that has been silent for a while.

After a stream's first byte, its client may hear nothing for long stretches: a decode that
stalls until the router gives up on it (`--stream-stall-timeout`), the migration that follows
(the new pair recomputes prompt and generated tokens first), a decode that retracts the request
under memory pressure. Proxies and load balancers between the client and the router close a
connection that stays silent past their read or idle timeout (nginx's `proxy_read_timeout`,
60 s; cloud load balancers' idle timeouts), which would end the very stream the router keeps
alive through the fault. So a stream silent for `--stream-keepalive-interval` seconds gets an
SSE comment, `: keep-alive`, which SSE clients skip (the `openai` SDK, browsers' EventSource,
httpx-sse, AIPerf): the HTML standard's server-sent events section recommends exactly this, a
comment line "every 15 seconds or so", against proxies that drop quiet connections.

One timer per stream, re-armed only when it fires: a write costs a clock read. The timer wakes
the stream's fan-in (`FanIn.wake_idle`) only while the stream waits for a chunk, never while a
write is blocked on a client that does not read (the write timeout handles that one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

KEEPALIVE = b": keep-alive\n\n"


class IdleTimer:
    """Calls `on_idle` once `interval` seconds have passed since the last `wrote()` (or the
    start), and every `interval` after that while nothing is written."""

    def __init__(self, interval: float, on_idle: Callable[[], None]):
        self._loop = asyncio.get_running_loop()
        self.interval = interval
        self._on_idle = on_idle
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self.last + interval, self._due)

    def wrote(self) -> None:
        self.last = self._loop.time()

    def _due(self) -> None:
        now = self._loop.time()
        due = self.last + self.interval
        if now >= due:
            self._on_idle()
            due = now + self.interval
        self._handle = self._loop.call_at(due, self._due)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
