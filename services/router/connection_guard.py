"""Bounds on what one client connection may hold, kept where uvicorn keeps the connection.

uvicorn (httptools) bounds an idle keep-alive connection in time, and nothing else: a connection
that sends half its headers, or none, stays open forever, headers of any size are buffered whole
(httptools keeps a header's value until it ends), and a response to a client that stops reading
waits forever on flow control (uvicorn's `send` awaits the transport's drain with no bound) while
the request holds its admission slot and its rooms on the workers. This protocol is uvicorn's,
with four guards:

- **headers in time**: from the connection's opening, and from the first byte of each further
  request on it, the headers must be complete within `header_timeout`; past it the client gets
  408 and the connection is closed.
- **headers in size**: the bytes received while a request's line and headers are incomplete are
  counted as they arrive; past `max_header_bytes` the client gets 431, before the parser buffers
  more. A chunked body's framing (chunk sizes, extensions, trailers: httptools buffers a trailer's
  value as it does a header's) is bounded the same way, by `max_header_bytes` beyond the body's
  own bytes: only chunks of a few bytes each come near it. Trailers are dropped, never merged
  into the request's headers. A read in which the headers (or the trailers) end may be mostly
  body, so there the parser's own pieces are counted instead: the URL as it is parsed, each
  header and trailer line as it completes; the first to pass the bound stops the parser. The
  connection then closes as nginx's lingering close does: our side shut for writing, what the
  client still sends read and dropped for `LINGER_SECONDS`, then cut. Closing at once with its
  bytes unread would reset the connection, and a reset can discard the 431 before the client
  reads it.
- **a reader that makes progress**: when the transport's write buffer passes its high-water mark
  (the client reads nothing, or far slower than we write) a `write_timeout` timer starts; the
  buffer draining below the low-water mark stops it. Past it the connection is aborted (not
  closed: closing waits for the unread buffer to flush), which uvicorn reports to the request as
  a client disconnect — the request then aborts its rooms and frees its slot as for any client
  that left.
- **a bounded number of connections**: at `max_connections`, a new connection closes the
  longest-idle one (no request in progress: between requests, or still sending headers); when
  none is idle it is refused.

A response whose body is whole before it is sent (every non-streamed answer) goes out in one
write (`write_whole`), with exactly the bytes uvicorn's two `send`s (start, body) would write in
two; the protocol's own bookkeeping after it (keep-alive, the next pipelined request) is
uvicorn's. Where that is not certain (the write buffer is full, a HEAD request, the response
begun) it declines and the ASGI path sends as usual.

A request's wait for its client to leave (`watch_disconnect`) is a callback the protocol calls
when it marks the request disconnected (the connection lost, or the request refused mid-body),
where a task waiting on the request's `receive()` for `http.disconnect` would wake: the same
moment, without a task per request.

Bytes the parser refuses get a 400 with an OpenAI error body, as every other refusal does
(uvicorn's own is plain text, and is written even in the middle of a pipelined response).

The body of a request is bounded by the application (services/router/request_body.py, `--body-timeout`,
`--max-body-reads`), which knows when it has read it; a stream's per-client buffer likewise
(services/router/fanout.py). Both reach the connection through `CONNECTION_EXTENSION` in the
ASGI scope, whose `abort()` cuts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

CONNECTION_EXTENSION = "pdmesh.connection"  # scope["extensions"][...]: the request's connection
CYCLE_EXTENSION = "pdmesh.cycle"  # scope["extensions"][...]: uvicorn's request-response cycle of the request
_HEADERS_LATE = "The request headers did not arrive in time."
_HEADERS_TOO_LARGE = "The request line and headers are larger than the limit of %d bytes."
_FRAMING_TOO_LARGE = "The chunked body's framing and trailers are more than %d bytes beyond its content."
_NOT_HTTP = "The request is not valid HTTP/1.1; the router could not parse it."


def closing_error(status: int, code: str, message: str) -> bytes:
    """A whole response with an OpenAI error body that closes the connection: what the server
    answers itself, for a request no application sees."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return b"%scontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (
        STATUS_LINE[status], len(body), body)


class _OverLimit(Exception):
    """A parser callback's way to stop httptools mid-read (it raises what a callback raised)."""


DEFAULT_MAX_HEADER_BYTES = 64 * 1024
LINGER_SECONDS = 2.0  # how long a refused client's further bytes are read and dropped before the cut


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    write_timeout: float
    max_connections: int
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards above; `guarded_protocol` binds its limits."""

    limits: ConnectionLimits
    on_cutoff: Callable[[str], None]  # called with the reason each time a guard cuts a connection

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None  # set once refused: reads are dropped
        self._idle_since: float | None = time.monotonic()  # None while a request is in progress
        self._aborted = False
        self._in_headers = True  # the next bytes are (part of) a request line and headers
        self._header_bytes = 0  # received since those began
        self._body_bytes = 0  # the request's body received, and all else since its headers
        self._framing_bytes = 0
        self._parsed_bytes = 0  # the request line's URL and the header lines parsed since they began
        self._trailer_bytes = 0  # a chunked body's trailer lines parsed
        self._over_limit = ""  # the refusal a parser callback stopped the parser for
        self._ended_request = False  # a request ended in the read being parsed
        self._began_body = False  # a request's headers ended in it
        # watch_disconnect's, each under a key of its own: (the request's cycle, the callback)
        self._gone_watchers: dict[object, tuple[RequestResponseCycle, Callable[[], None]]] = {}

    # --- connections ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # over TLS, the handshake that made this connection held its place until now (tls.py)
        handshake = self.__dict__.pop("handshake", None)
        if handshake is not None:
            self.connections.discard(handshake)
        room = self._make_room()
        super().connection_made(transport)
        if not room:
            self._cut("connection_limit")
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        # uvicorn marks only the newest request disconnected: an older one still being answered
        # (pipelined) has lost its client as well, and would otherwise run on until its deadline
        for cycle, _ in self._gone_watchers.values():
            if not cycle.response_complete:
                cycle.disconnected = True
        self._tell_gone()

    def watch_disconnect(self, cycle: RequestResponseCycle, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` once `cycle`'s client is gone, on the loop iteration a task waiting
        on its `receive()` for `http.disconnect` would wake in; returns what stops the watch. For
        a request whose body is read: its `receive()` is then only ever waiting for that."""
        watchers, key = self._gone_watchers, object()
        watchers[key] = (cycle, callback)
        if cycle.disconnected or cycle.response_complete:  # receive() would answer at once
            self.loop.call_soon(self._call_gone, key)
        else:
            cycle.flow.resume_reading()  # as receive() does before it waits: a close is seen while reading
        return lambda: watchers.pop(key, None)  # type: ignore[return-value]

    def _tell_gone(self) -> None:
        """The watchers of the requests now marked disconnected (uvicorn marks the current one),
        called soon, as a waiting task's wake-up would run."""
        for key, (cycle, _) in self._gone_watchers.items():
            if cycle.disconnected:
                self.loop.call_soon(self._call_gone, key)

    def _call_gone(self, key: object) -> None:
        watch = self._gone_watchers.pop(key, None)
        if watch is not None:  # not unwatched meanwhile
            watch[1]()

    def _make_room(self) -> bool:
        return make_room(self.connections, self.limits.max_connections)

    def abort(self) -> None:
        """Cut the connection now, whatever its buffers hold (the request sees a disconnect)."""
        if not self._aborted:
            self._aborted = True
            self._cancel_timers()
            self.transport.abort()

    def _cut(self, reason: str) -> None:
        if not self._aborted:
            self.on_cutoff(reason)
        self.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._write_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._write_timer = None

    # --- headers --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # refused: what it still sends is dropped unparsed
        self._ended_request = self._began_body = False
        body_before = self._body_bytes
        self._feed(data)
        if self._aborted or self._ended_request or self._began_body:
            return
        limit = self.limits.max_header_bytes
        if self._in_headers:
            self._header_bytes += len(data)
            if self._header_bytes > limit:
                self._refuse(_HEADERS_TOO_LARGE % limit)
        else:
            self._framing_bytes += len(data) - (self._body_bytes - body_before)
            if self._framing_bytes > limit + self._body_bytes:
                self._refuse(_FRAMING_TOO_LARGE % limit)

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, except that a parser stopped by a bound is refused as such,
        not logged and answered as bytes that are not HTTP."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._over_limit:
                self._refuse(self._over_limit)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        if self._parsed_bytes > self.limits.max_header_bytes:
            self._stop_parsing(_HEADERS_TOO_LARGE)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 4  # "name: value\r\n"
        if self._in_headers:  # not a trailer
            self._parsed_bytes += size
            if self._parsed_bytes > self.limits.max_header_bytes:
                self._stop_parsing(_HEADERS_TOO_LARGE)
            super().on_header(name, value)
        else:
            self._trailer_bytes += size
            if self._trailer_bytes > self.limits.max_header_bytes:
                self._stop_parsing(_FRAMING_TOO_LARGE)

    def _stop_parsing(self, message: str) -> None:
        """Raised from a parser callback: httptools stops there, and `_feed` refuses the request."""
        self._over_limit = message % self.limits.max_header_bytes
        raise _OverLimit(self._over_limit)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers, self._header_bytes, self._ended_request = True, 0, True

    def _refuse(self, message: str) -> None:
        self._over_limit = ""
        self.on_cutoff("header_size")
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._in_headers or cycle.response_started:
                # an earlier request (pipelined) or this one is being answered: no answer can be
                # written in between
                self.abort()
                return
            # this request's body was still arriving: to the app its client has left (its sends
            # are dropped), and the answer is ours
            cycle.disconnected = True
            cycle.message_event.set()
            self._tell_gone()
        self.transport.write(closing_error(431, "request_header_fields_too_large", message))
        self._aborted = True  # no request runs on it any more, and it no longer counts as live
        self._cancel_timers()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.abort)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # bytes httptools cannot parse; uvicorn's own answer is plain text, and would be written
        # in the middle of a pipelined response still going out
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                self.abort()
                return
            cycle.disconnected = True  # the request's app sends nothing more on it
            cycle.message_event.set()
            self._tell_gone()
        self.transport.write(closing_error(400, "invalid_http", _NOT_HTTP))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self._aborted:
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._aborted or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a further request's headers begun while a response is still going out (pipelined):
            # no answer can be written now; they are bounded again from here
            self._arm_header_timer()
            return
        self.on_cutoff("header_timeout")
        # a short answer fits the socket's buffer whatever the client does; then closed as usual
        self.transport.write(closing_error(408, "request_timeout", _HEADERS_LATE))
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_bytes = self._trailer_bytes = 0
        self.scope["extensions"] = {CONNECTION_EXTENSION: self}
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._in_headers, self._header_bytes, self._began_body = False, 0, True
        self._body_bytes = self._framing_bytes = 0
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._idle_since = None
        scope = self.scope
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is scope:  # not an upgrade: this request's own cycle
            scope["extensions"][CYCLE_EXTENSION] = cycle

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()

    # --- writes ---------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None and not self._aborted:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._reader_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _reader_stalled(self) -> None:
        self._write_timer = None
        self._cut("write_timeout")


def write_whole(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """Send a whole response (status, headers with its content-length, body) in one write, as
    uvicorn's `send` of the start and of the last body would in two; False (nothing written)
    where this cannot be sure to do the same, and the caller then sends through ASGI."""
    if (cycle.response_started or cycle.disconnected or cycle.flow.write_paused
            or cycle.scope["method"] == "HEAD" or status in (204, 304)):
        return False
    content = [STATUS_LINE[status]]
    length = None
    close = False
    for name, value in (*cycle.default_headers, *headers):
        if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
            return False  # ASGI's path raises for it, as it would without this
        name = name.lower()
        if name == b"content-length":
            length = int(value.decode()) if length is None else length
        elif name == b"transfer-encoding":
            return False
        elif name == b"connection" and b"close" in [t.lower().strip() for t in value.split(b",")]:
            close = True
        content += (name, b": ", value, b"\r\n")
    if length != len(body):
        return False
    if close:
        cycle.keep_alive = False
    elif not cycle.keep_alive:
        content.append(b"connection: close\r\n")
    content += (b"\r\n", body)
    if cycle.access_log:  # uvicorn's access line, as its send of the start writes it
        scope = cycle.scope
        cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                 get_path_with_query_string(scope), scope["http_version"], status)
    cycle.response_started = cycle.response_complete = True
    cycle.waiting_for_100_continue = False
    cycle.transport.write(b"".join(content))
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def take_whole_body(scope: dict) -> bytes | None:
    """The request's body when uvicorn (under the guarded protocol) has all of it already, taken
    as `receive()` would take it (what receive() returns then comes without a wait, so the body
    needs no timer); None while some of it is still to come, once taken or when the request is
    gone, and under another server: the caller then reads it through `receive()`."""
    cycle = (scope.get("extensions") or {}).get(CYCLE_EXTENSION)
    if cycle is None or cycle.more_body or cycle.disconnected or cycle.response_complete:
        return None
    if not cycle.message_event.is_set():
        return None  # taken already: receive() would wait for the next message
    cycle.waiting_for_100_continue = False  # all of it came without waiting for the 100
    cycle.flow.resume_reading()
    cycle.message_event.clear()
    body = bytes(cycle.body)
    cycle.body = bytearray()
    return body


def watch_disconnect(scope: dict, callback: Callable[[], None]) -> Callable[[], None] | None:
    """GuardedHttpToolsProtocol.watch_disconnect for the request of this ASGI scope; None when
    another server serves it (the caller then waits on `receive()`)."""
    extensions = scope.get("extensions") or {}
    connection, cycle = extensions.get(CONNECTION_EXTENSION), extensions.get(CYCLE_EXTENSION)
    if not isinstance(connection, GuardedHttpToolsProtocol) or cycle is None:
        return None
    return connection.watch_disconnect(cycle, callback)


def make_room(connections: set, max_connections: int) -> bool:
    """Whether a new connection may stay: under the limit, or after the longest-idle one went.
    `connections`: uvicorn's, holding the guarded protocols and, over TLS, the handshakes still
    going on (services/router/tls.py): each with `_idle_since` (None while a request is in
    progress), `_aborted`, `transport` (None for a handshake) and `_cut(reason)`."""
    if len(connections) < max_connections:
        return True
    live = [p for p in connections if hasattr(p, "_idle_since") and not p._aborted
            and not (p.transport is not None and p.transport.is_closing())]
    if len(live) < max_connections:
        return True
    idle = [p for p in live if p._idle_since is not None]
    if not idle:
        return False
    min(idle, key=lambda p: p._idle_since)._cut("connection_limit")
    return True


def guarded_protocol(limits: ConnectionLimits, on_cutoff: Callable[[str], None]) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), bound to these limits."""
    return type("RouterHttpProtocol", (GuardedHttpToolsProtocol,), {"limits": limits,
                                                                   "on_cutoff": staticmethod(on_cutoff)})
