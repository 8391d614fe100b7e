"""A gRPC bidirectional stream on the router's own HTTP/2 connection: asyncio, no gRPC library.

Why: the lane (services/router/lane.py) is one long-lived stream per worker carrying
length-prefixed protobuf messages. On grpc.aio every message is handed between the event loop and
gRPC C-core's threads: the stream's `read` was the largest single cost of a streamed response in
the router's profile, and at one request at a time each hop wakes a thread (docs/router.md "The
lane"). Here the frames are parsed in the loop's own `data_received`, and a message is one
`transport.write`. The worker keeps its gRPC server: this speaks gRPC over HTTP/2 to it.

`H2Stream` has the shape of grpc.aio's StreamStreamCall as the lane uses it: `await write(msg)`,
`await read()` (a message, then `grpc.aio.EOF`), `cancel()`; a failure raises
`grpc.aio.AioRpcError` with the status the worker ended the stream with (its trailers), or
UNAVAILABLE when the connection could not be made, was lost, or went silent.

What of HTTP/2 (RFC 9113) and gRPC's mapping onto it it implements:
- one connection per stream (the lane opens a new stream only after the last one ended);
- the preface, SETTINGS (no push, a large receive window) and their acks, PING acks;
- sending within the worker's connection and stream windows and its frame size; `write` waits
  for window, and for the socket's buffer to drain (pause/resume_writing), so a slow worker
  pushes back on the writer instead of growing memory;
- receiving: messages split across DATA frames, the receive window refilled as data arrives;
  a message over `max_message_bytes` ends the stream (RESOURCE_EXHAUSTED), as in grpc;
- request headers as HPACK literals (no dynamic table); the worker's headers and trailers
  decoded with `hpack`; grpc-status / grpc-message and the trailing metadata from them;
- RST_STREAM and GOAWAY (a GOAWAY that excludes the stream ends it; one that does not lets it
  run to its end, as the worker drains);
- keep-alive: a PING after every `keepalive_time` in which nothing came from the worker, and a
  stream whose PING is not answered (nor anything else heard) within `keepalive_timeout` fails
  with UNAVAILABLE: a frozen worker or a partition is found whatever the TCP connection says.
  (grpc.aio's keep-alive on the same settings did not: its lane to a SIGSTOPped worker failed
  after about a minute, C-core limiting the pings it sends while no data is sent.)
- connecting is bounded by `connect_timeout`.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import Callable
from urllib.parse import unquote

import grpc
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# frame types
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 2, 4, 5
DEFAULT_WINDOW = 65_535
RECEIVE_WINDOW = 1 << 24  # what the worker may send ahead of this side's window updates
MAX_FRAME = 1 << 20  # the largest frame this side accepts (the worker's frames may be up to it)
STREAM_ID = 1
_HEAD = struct.Struct(">HBBBI")  # a frame header: length (24 bits: 16 + 8), type, flags, stream id
_PREFIX = struct.Struct(">BI")  # a gRPC message prefix: compressed flag, length
CODES = {code.value[0]: code for code in grpc.StatusCode}  # a status code's number → grpc.StatusCode
# HTTP status → gRPC status, for a response that is not gRPC's (gRPC's own mapping)
_HTTP_CODES = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
               429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
# RST_STREAM error code → gRPC status (REFUSED_STREAM: not processed, CANCEL, ENHANCE_YOUR_CALM)
_RST_CODES = {7: grpc.StatusCode.UNAVAILABLE, 8: grpc.StatusCode.CANCELLED, 11: grpc.StatusCode.RESOURCE_EXHAUSTED,
              12: grpc.StatusCode.PERMISSION_DENIED}
_NOT_METADATA = {"content-type", "grpc-status", "grpc-message", "grpc-encoding", "grpc-accept-encoding"}


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, ftype, flags, stream) + payload


def host_port(addr: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port` / `[v6]:port` address; None for what only gRPC's own
    resolver understands (a scheme such as `dns:///`, `unix:`, no port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        host = host[1:-1]
    elif ":" in host:
        return None  # a scheme ("unix:path:1") or a bare IPv6 address without brackets
    return host, int(port)


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out, value = [first | top], value - top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """An HPACK block of literal fields without indexing, new names, no Huffman coding: the
    worker's decoder needs no state from this side."""
    out = bytearray()
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return bytes(out)


def call_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    """The error grpc.aio would raise for a call that ended with this status and trailing metadata."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


class H2Stream(asyncio.Protocol):
    """One bidirectional gRPC stream to `addr` (`host:port`) at `path` on a connection of its own.

    `serialize(message) -> bytes` and `deserialize(bytes) -> message` are the method's; `metadata`
    the request's headers ((key, value) pairs, e.g. the internal token)."""

    def __init__(self, addr: str, path: str, serialize: Callable, deserialize: Callable,
                 metadata: tuple = (), *, max_message_bytes: int, keepalive_time: float,
                 keepalive_timeout: float, connect_timeout: float) -> None:
        hp = host_port(addr)
        if hp is None:
            raise ValueError(f"not a host:port address: {addr!r}")
        self._loop = asyncio.get_running_loop()
        self.addr, self._path = addr, path
        self._serialize, self._deserialize = serialize, deserialize
        self._max_message = max_message_bytes
        self._keepalive_time, self._keepalive_timeout = keepalive_time, keepalive_timeout
        self._transport: asyncio.Transport | None = None
        self._in = bytearray()  # bytes received, not yet a whole frame
        self._msg = bytearray()  # a gRPC message's bytes gathered across DATA frames
        self._block: bytearray | None = None  # a header block gathered across CONTINUATION frames
        self._block_ends = False  # that block's HEADERS frame carried END_STREAM
        self._decoder = hpack.Decoder()
        self._decoder.max_allowed_table_size = 1 << 16
        self._have_headers = False  # the response's headers are in (what follows with END_STREAM: trailers)
        self._messages: collections.deque = collections.deque()
        self._reader: asyncio.Future | None = None
        self._on_message: Callable | None = None  # on_messages(): each message handed over as parsed
        self._end: BaseException | object | None = None  # grpc.aio.EOF, an AioRpcError, CancelledError
        self._unacked = 0  # bytes received since this side last refilled the worker's windows
        self._out = bytearray()  # DATA payload waiting for window
        self._conn_window = self._stream_window = DEFAULT_WINDOW
        self._initial_window = DEFAULT_WINDOW
        self._max_frame = 16_384
        self._writable: asyncio.Future | None = None  # a write waiting for window or a drained socket
        self._paused = False
        self._ping_timer: asyncio.TimerHandle | None = None
        self._heard_at = self._ping_sent_at = 0.0  # loop times: the last bytes from the worker, the last ping
        self._ready = self._loop.create_future()  # the connection is made and the request headers sent
        self._ready.add_done_callback(_retrieve)
        self._request_headers = [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", addr),
            ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "pdmesh-router-lane"),
            *((k, v) for k, v in metadata)]
        self._connecting = asyncio.ensure_future(self._connect(hp, connect_timeout))

    # --- the stream, as grpc.aio's -------------------------------------------------------------

    async def write(self, message) -> None:
        if self._end is None and not self._ready.done():
            await self._ready
        if self._end is not None:
            raise self._end_error()
        data = self._serialize(message)
        self._out += _PREFIX.pack(0, len(data))
        self._out += data
        self._flush()
        while (self._out or self._paused) and self._end is None:
            self._writable = self._loop.create_future()
            await self._writable
        if self._out and self._end is not None:
            raise self._end_error()

    def try_write(self, message) -> bool:
        """write() without waiting, where it would not wait: the stream is open and nothing of an
        earlier message is still waiting for window or a drained socket. False: nothing written,
        use write()."""
        if self._end is not None or self._out or self._paused or not self._ready.done():
            return False
        data = self._serialize(message)
        self._out += _PREFIX.pack(0, len(data))
        self._out += data
        self._flush()
        return True

    def read(self) -> asyncio.Future:
        """A future of the next message (already done when one is in), then of grpc.aio.EOF."""
        fut = self._loop.create_future()
        if self._messages:
            fut.set_result(self._messages.popleft())
        elif self._end is not None:
            settle(fut, self._end)
        else:
            self._reader = fut
        return fut

    def on_messages(self, callback: Callable) -> None:
        """Hand each message to `callback(message)` as soon as it is parsed, from the connection's
        own callback, instead of queueing it for read(), which then gives only the stream's end
        (grpc.aio.EOF or the error): the reader saves a wake-up per message. `callback` must not
        raise."""
        self._on_message = callback
        while self._messages:
            callback(self._messages.popleft())

    def cancel(self) -> bool:
        if self._end is not None:
            return False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(RST_STREAM, 0, STREAM_ID, (8).to_bytes(4, "big")))
        self._finish(asyncio.CancelledError())
        return True

    def done(self) -> bool:
        return self._end is not None

    # --- connection ----------------------------------------------------------------------------

    async def _connect(self, hp: tuple[str, int], timeout: float) -> None:
        try:
            await asyncio.wait_for(self._loop.create_connection(lambda: self, *hp), timeout)
        except asyncio.CancelledError:
            self._finish(call_error(grpc.StatusCode.CANCELLED, "cancelled while connecting"))
            raise
        except (TimeoutError, OSError) as e:
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else str(e)
            self._finish(call_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self.addr}: {reason}"))

    def connection_made(self, transport) -> None:
        self._transport = transport
        if self._end is not None:  # cancelled while connecting
            transport.close()
            return
        # the preface first, before anything else is written: the worker's SETTINGS may arrive
        # (and be acked) before the connect coroutine resumes
        settings = b"".join(struct.pack(">HI", k, v) for k, v in (
            (SETTINGS_ENABLE_PUSH, 0), (SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW), (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME)))
        transport.write(PREFACE + frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, (RECEIVE_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
                        + frame(HEADERS, END_HEADERS, STREAM_ID, encode_headers(self._request_headers)))
        self._ready.set_result(None)
        self._schedule_ping()

    def connection_lost(self, exc) -> None:
        self._cancel_ping()
        if self._end is None:
            why = f": {exc}" if exc else ""
            self._finish(call_error(grpc.StatusCode.UNAVAILABLE, f"connection to {self.addr} lost{why}"))
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    def eof_received(self):
        return None  # close: the worker will send nothing more

    # --- frames in -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._heard_at = self._loop.time()
        buf = self._in
        if buf:
            buf += data
            # a large frame arrives in many reads: join only once it is whole (not once per read)
            if len(buf) < 9 or len(buf) < 9 + (buf[0] << 16 | buf[1] << 8 | buf[2]):
                return
            data = bytes(buf)
            buf.clear()
        pos, n = 0, len(data)
        while n - pos >= 9 and self._end is None:
            hi, lo, ftype, flags, sid = _HEAD.unpack_from(data, pos)
            length = hi << 8 | lo
            if n - pos - 9 < length:
                break
            if length > MAX_FRAME:
                return self._protocol_error(f"a frame of {length} bytes, over this side's {MAX_FRAME}")
            payload = data[pos + 9:pos + 9 + length]
            pos += 9 + length
            if ftype == DATA:
                self._data(flags, sid, payload, length)
            else:
                self._control(ftype, flags, sid & 0x7FFF_FFFF, payload)
        if pos < n and self._end is None:
            buf += data[pos:]

    def _data(self, flags: int, sid: int, payload: bytes, length: int) -> None:
        self._unacked += length
        if self._unacked >= RECEIVE_WINDOW // 2:
            inc = self._unacked.to_bytes(4, "big")
            self._unacked = 0
            self._transport.write(frame(WINDOW_UPDATE, 0, 0, inc) + frame(WINDOW_UPDATE, 0, STREAM_ID, inc))
        if sid != STREAM_ID:
            return
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        msg = self._msg
        if msg:
            msg += payload
            payload = bytes(msg)
            msg.clear()
        pos, n = 0, len(payload)
        while n - pos >= 5:
            compressed, size = _PREFIX.unpack_from(payload, pos)
            if size > self._max_message:
                return self._fail_and_reset(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"received message larger than max ({size} vs. {self._max_message})")
            if compressed:
                return self._fail_and_reset(grpc.StatusCode.INTERNAL, "a compressed message (none was offered)")
            if n - pos - 5 < size:
                break
            self._deliver(self._deserialize(payload[pos + 5:pos + 5 + size]))
            pos += 5 + size
        if pos < n:
            msg += payload[pos:]
        if flags & END_STREAM and self._end is None:
            self._finish(call_error(grpc.StatusCode.INTERNAL, "the stream ended without trailers"))

    def _deliver(self, message) -> None:
        if self._on_message is not None:
            self._on_message(message)
            return
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.set_result(message)
        else:
            self._messages.append(message)

    def _control(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self._block, self._block_ends = bytearray(payload), bool(flags & END_STREAM)
            if flags & END_HEADERS:
                self._headers_done(sid)
        elif ftype == CONTINUATION:
            if self._block is None:
                return self._protocol_error("CONTINUATION without HEADERS")
            self._block += payload
            if flags & END_HEADERS:
                self._headers_done(sid)
        elif ftype == SETTINGS:
            if not flags & ACK:
                # acked before anything is sent under the new values: gRPC's side counts a larger
                # window from the ack on, and DATA sent ahead of it resets the stream
                self._transport.write(frame(SETTINGS, ACK, 0))
                self._settings(payload)
        elif ftype == PING:
            if flags & ACK:
                self._schedule_ping()  # answered: the worker is alive; the next one in keepalive_time
            else:
                self._transport.write(frame(PING, ACK, 0, payload))
        elif ftype == WINDOW_UPDATE:
            inc = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
            if sid == 0:
                self._conn_window += inc
            elif sid == STREAM_ID:
                self._stream_window += inc
            self._flush()
        elif ftype == RST_STREAM and sid == STREAM_ID:
            code = int.from_bytes(payload[:4], "big")
            self._finish(call_error(_RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                                   f"stream reset by {self.addr} (HTTP/2 error code {code})"))
        elif ftype == GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
            code = int.from_bytes(payload[4:8], "big")
            if last < STREAM_ID or code != 0:
                debug = payload[8:].decode(errors="replace")
                self._fail(grpc.StatusCode.UNAVAILABLE,
                                     f"{self.addr} went away (HTTP/2 error code {code}{': ' + debug if debug else ''})")
            # else the worker finishes this stream before it closes (a graceful shutdown)

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                self._stream_window += value - self._initial_window
                self._initial_window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._max_frame = value
        self._flush()

    def _headers_done(self, sid: int) -> None:
        block, self._block = bytes(self._block), None
        try:
            headers = self._decoder.decode(block)  # every block, in order: the decoder's table needs them
        except hpack.HPACKError as e:
            return self._protocol_error(f"a header block that does not decode: {e}")
        if sid != STREAM_ID:
            return
        fields = dict(headers)
        if not self._have_headers:
            self._have_headers = True
            status = fields.get(":status", "")
            if status != "200" and "grpc-status" not in fields:
                code = _HTTP_CODES.get(int(status) if status.isdigit() else 0, grpc.StatusCode.UNKNOWN)
                return self._fail_and_reset(code, f"HTTP status {status} from {self.addr}")
            if not self._block_ends:
                return
        elif not self._block_ends:
            return  # headers in the middle of the stream: not gRPC's, ignored
        self._trailers(fields, headers)

    def _trailers(self, fields: dict, headers: list) -> None:
        value = fields.get("grpc-status")
        code = CODES.get(int(value), grpc.StatusCode.UNKNOWN) if value and value.isdigit() else None
        if code is None:
            self._finish(call_error(grpc.StatusCode.UNKNOWN, "the stream ended without a grpc-status"))
        elif code == grpc.StatusCode.OK:
            self._finish(grpc.aio.EOF)
        else:
            trailing = tuple((k, v) for k, v in headers if not k.startswith(":") and k not in _NOT_METADATA)
            self._finish(call_error(code, unquote(fields.get("grpc-message", "")), trailing))

    # --- frames out ----------------------------------------------------------------------------

    def _flush(self) -> None:
        out, transport = self._out, self._transport
        if transport is None or not self._ready.done():
            return
        while out and self._conn_window > 0 and self._stream_window > 0:
            n = min(len(out), self._conn_window, self._stream_window, self._max_frame)
            transport.write(frame(DATA, 0, STREAM_ID, bytes(out[:n])) if n < len(out)
                            else frame(DATA, 0, STREAM_ID, bytes(out)))
            del out[:n]
            self._conn_window -= n
            self._stream_window -= n
        if not out:
            self._wake_writer()

    def _wake_writer(self) -> None:
        if self._paused and self._end is None:
            return
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # --- keep-alive ----------------------------------------------------------------------------

    def _schedule_ping(self) -> None:
        self._cancel_ping()
        if self._end is None:
            self._ping_timer = self._loop.call_later(self._keepalive_time, self._ping)

    def _ping(self) -> None:
        if self._end is not None or self._transport is None:
            return
        quiet = self._loop.time() - self._heard_at
        if quiet < self._keepalive_time:
            # frames came in meanwhile: the worker is alive; a ping only after a quiet spell
            self._ping_timer = self._loop.call_later(self._keepalive_time - quiet, self._ping)
            return
        self._ping_sent_at = self._loop.time()
        self._transport.write(frame(PING, 0, 0, b"pdmeshka"))
        self._ping_timer = self._loop.call_later(self._keepalive_timeout, self._ping_unanswered)

    def _ping_unanswered(self) -> None:
        self._ping_timer = None
        if self._heard_at >= self._ping_sent_at:
            self._schedule_ping()  # anything heard since the ping proves the worker alive
            return
        self._fail(grpc.StatusCode.UNAVAILABLE,
                             f"{self.addr} did not answer a keep-alive ping within {self._keepalive_timeout} s")

    def _cancel_ping(self) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None

    # --- the end -------------------------------------------------------------------------------

    def _finish(self, end) -> None:
        if self._end is not None:
            return
        self._end = end
        self._cancel_ping()
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            settle(reader, end)
        if not self._ready.done():
            self._ready.set_exception(self._end_error())
        if not self._connecting.done() and asyncio.current_task() is not self._connecting:
            self._connecting.cancel()
        if self._transport is not None:
            self._transport.close()  # the stream is over, and the connection was its alone (buffered frames still go)
        self._wake_writer()

    def _end_error(self) -> BaseException:
        end = self._end
        if isinstance(end, BaseException):
            return end
        return call_error(grpc.StatusCode.INTERNAL, "the stream is over")  # EOF: nothing more can be written

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        self._finish(call_error(code, details))  # which closes the connection

    def _fail_and_reset(self, code: grpc.StatusCode, details: str) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(RST_STREAM, 0, STREAM_ID, (8).to_bytes(4, "big")))
        self._fail(code, details)

    def _protocol_error(self, details: str) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(GOAWAY, 0, 0, (0).to_bytes(4, "big") + (1).to_bytes(4, "big")))
        self._fail(grpc.StatusCode.INTERNAL, f"HTTP/2 protocol error from {self.addr}: {details}")


def settle(fut: asyncio.Future, end) -> None:
    """Resolve a reader's future with a stream's end: EOF as its result, an error raised,
    CancelledError as the future's cancellation."""
    if isinstance(end, asyncio.CancelledError):
        fut.cancel()
    elif isinstance(end, BaseException):
        fut.set_exception(end)
    else:
        fut.set_result(end)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a connection that failed before any write: not an unretrieved error
