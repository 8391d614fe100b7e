"""A tiny HTTP/1.1 server on the worker's asyncio loop for /metrics and /health.

Workers speak gRPC for real traffic; this only answers scrapes and probes, so a few dozen
lines on asyncio streams beat pulling a web framework into every worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# handler() -> (status code, content type, body)
Handler = Callable[[], Awaitable[tuple[int, str, bytes]]]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable"}


async def start_status_server(host: str, port: int, routes: dict[str, Handler]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request_line = await asyncio.wait_for(reader.readline(), timeout=30)
                except (TimeoutError, ConnectionError):
                    return
                if not request_line:
                    return
                # drain headers; we never read a body (GET/HEAD only)
                while True:
                    line = await asyncio.wait_for(reader.readline(), timeout=30)
                    if line in (b"\r\n", b"\n", b""):
                        break
                parts = request_line.decode("latin-1").split()
                if len(parts) != 3:
                    await _respond(writer, 400, "text/plain", b"bad request\n", False)
                    return
                method, target, _ = parts
                path = target.split("?", 1)[0]
                keep_alive = True
                if method not in ("GET", "HEAD"):
                    await _respond(writer, 405, "text/plain", b"method not allowed\n", keep_alive)
                elif path not in routes:
                    await _respond(writer, 404, "text/plain", b"not found\n", keep_alive)
                else:
                    status, ctype, body = await routes[path]()
                    await _respond(writer, status, ctype, b"" if method == "HEAD" else body, keep_alive)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, reuse_address=True)


async def _respond(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes, keep_alive: bool) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
