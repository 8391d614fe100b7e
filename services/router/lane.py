"""The router's end of the lane: Prefill / Decode calls to one worker over one bidirectional stream.

`LaneStub` has the shape of the worker's generated stub, and `LaneTransport` (the worker's
transport, services/router/transport.py) makes its Prefill / Decode calls through it:
`Prefill(request, timeout=)` and `Decode(request, timeout=)` return call objects that behave as
grpc.aio's do for the router's uses — a Prefill call is awaited for its reply, a Decode call is `read()` chunk by
chunk until `grpc.aio.EOF`, both `cancel()`, and a failure raises `grpc.aio.AioRpcError` with
the status the worker (or the lane) ended the call with. Everything else (Load, Abort) goes to
the worker's own stub.

Why: a new gRPC call costs grpc.aio 150-250 µs of the router's one core (call objects, the
C-core's threads handing events to the loop); a message on an open stream costs a few µs and
carries every call entry ready when it is written (docs/router.md "The lane"). The worker runs
each call as the RPC of the same name (services/common/lane_server.py).

Bounds, as with one RPC per call: each call has its deadline as a timer here (DEADLINE_EXCEEDED
and a cancel entry; the worker holds the same timeout); the stream lives on the worker's
keep-alive channel, and when it fails (worker gone, partition, keep-alive timeout) every call on
it fails with the stream's status, UNAVAILABLE typically, and the next call opens a new stream.
A worker without the Lane method (UNIMPLEMENTED) gets one RPC per call from then on, the calls
already sent re-issued that way.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.grpc_server import (
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    MAX_MESSAGE_BYTES,
    TOKEN_KEY,
    internal_token,
)
from services.common.lane_batches import LANE_MESSAGE_BYTES, batches, entry_bytes
from services.common.logging_setup import get_logger
from services.common.refusal import refusal_metadata
from services.router.h2_stream import CODES, H2Stream, call_error, host_port, settle

log = get_logger("router.lane")
CLIENTS = ("h2", "grpc")  # what carries the lane's stream: the router's own HTTP/2 (h2_stream.py) or grpc.aio
KEEPALIVE = (KEEPALIVE_TIME_MS / 1000, KEEPALIVE_TIMEOUT_MS / 1000)  # (time, timeout) by default, seconds


def lane_path(stub) -> str:
    """The Lane method's path on the service of a generated stub (PrefillStub → /pdmesh.v1.Prefill/Lane)."""
    return f"/{wpb.DESCRIPTOR.package}.{type(stub).__name__.removesuffix('Stub')}/Lane"


def rpc_error(code: grpc.StatusCode, details: str, refusal: int = 0) -> grpc.aio.AioRpcError:
    """The error grpc.aio would raise; a worker's refusal code goes where an RPC carries it (its
    trailing metadata, services/common/refusal.py), so the router reads both the same way."""
    return call_error(code, details, refusal_metadata(refusal) if refusal else ())


class _Call:
    """One call on a lane; subclasses give it grpc.aio's shape."""

    def __init__(self, lane: Lane, cid: int, request, timeout: float | None) -> None:
        self.lane, self.cid, self.request = lane, cid, request
        self.done = False
        self.finished = False  # Decode: the chunk with the finish reason is in, the worker's call is over
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout is None else loop.time() + timeout
        self._timer = None if timeout is None else loop.call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self.done:
            self.lane.cancel(self)
            self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _over(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> bool:
        if self.done:
            return False
        # a Decode call whose last chunk is in ends on the worker by itself: cancelling it there
        # would only abort a room that is already done
        self.lane.cancel(self, tell_worker=not self.finished)
        self._over()
        self._cancelled()
        return True

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - asyncio.get_running_loop().time())


class LanePrefillCall(_Call):
    """Awaitable for its PrefillReply, as grpc.aio's UnaryUnaryCall."""

    def __init__(self, lane: Lane, cid: int, request, timeout: float | None) -> None:
        super().__init__(lane, cid, request, timeout)
        self._future = asyncio.get_running_loop().create_future()
        self._future.add_done_callback(self._future_done)
        self._rpc = None  # the per-call RPC it became on a worker without a lane

    def _future_done(self, fut: asyncio.Future) -> None:
        # the task awaiting this call was cancelled (which cancels the future): end the call too
        if fut.cancelled() and not self.done:
            self.lane.cancel(self)
            self._over()
            if self._rpc is not None:
                self._rpc.cancel()

    def __await__(self):
        return self._future.__await__()

    @property
    def future(self) -> asyncio.Future:
        """The reply's future, for a caller that would otherwise wrap this call in a task to get
        one: cancelling it cancels the call, as cancelling that task would."""
        return self._future

    def deliver(self, reply: wpb.LaneReply) -> None:
        kind = reply.WhichOneof("msg")
        if kind == "prefill":
            self._over()
            if not self._future.done():
                self._future.set_result(reply.prefill)
        elif kind == "end":
            self.fail(rpc_error(CODES.get(reply.end.code, grpc.StatusCode.UNKNOWN), reply.end.details, reply.end.refusal)
                      if reply.end.code else rpc_error(grpc.StatusCode.INTERNAL, "Prefill call ended without a reply"))

    def fail(self, error: BaseException) -> None:
        self._over()
        if not self._future.done():
            self._future.set_exception(error)

    def _cancelled(self) -> None:
        if self._rpc is not None:
            self._rpc.cancel()
        self._future.cancel()

    def fall_back(self, stub) -> None:
        self._rpc = stub.Prefill(self.request, timeout=self.remaining())

        def copy(rpc_task: asyncio.Future) -> None:
            if self._future.done():
                return
            if rpc_task.cancelled():
                self._future.cancel()
            elif rpc_task.exception() is not None:
                self._future.set_exception(rpc_task.exception())
            else:
                self._future.set_result(rpc_task.result())
            self._over()

        asyncio.ensure_future(self._rpc).add_done_callback(copy)


class LaneDecodeCall(_Call):
    """`read()` the chunks until grpc.aio.EOF, as grpc.aio's UnaryStreamCall."""

    def __init__(self, lane: Lane, cid: int, request, timeout: float | None) -> None:
        super().__init__(lane, cid, request, timeout)
        self._chunks: collections.deque = collections.deque()
        self._end: BaseException | object | None = None  # grpc.aio.EOF, an AioRpcError or CancelledError
        self._waiter: asyncio.Future | None = None
        self._pump: asyncio.Task | None = None

    def read(self) -> asyncio.Future:
        """A future of the next chunk (already done when one is queued): the router's per-chunk
        wait costs no task."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._chunks:
            fut.set_result(self._chunks.popleft())
        elif self._end is not None:
            settle(fut, self._end)
        else:
            self._waiter = fut
        return fut

    def _push(self, item) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(item)
        else:
            self._chunks.append(item)

    def _finish(self, end) -> None:
        if self._end is not None:
            return
        self._end = end
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            settle(waiter, end)

    def deliver(self, reply: wpb.LaneReply) -> None:
        kind = reply.WhichOneof("msg")
        if kind == "chunk":
            self._push(reply.chunk)
            if reply.chunk.finish_reason:
                self.finished = True
        elif kind == "end":
            self._over()
            code = CODES.get(reply.end.code, grpc.StatusCode.UNKNOWN)
            self._finish(grpc.aio.EOF if code == grpc.StatusCode.OK
                         else rpc_error(code, reply.end.details, reply.end.refusal))

    def fail(self, error: BaseException) -> None:
        self._over()
        self._finish(error)

    def _cancelled(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        self._finish(asyncio.CancelledError())

    def fall_back(self, stub) -> None:
        rpc = stub.Decode(self.request, timeout=self.remaining())

        async def pump() -> None:
            try:
                async for chunk in rpc:
                    self._push(chunk)
                self.fail(grpc.aio.EOF)  # type: ignore[arg-type] - the normal end
            except grpc.aio.AioRpcError as e:
                self.fail(e)
            except asyncio.CancelledError:
                rpc.cancel()
                raise

        self._pump = asyncio.ensure_future(pump())


class Lane:
    """One worker's lane: opened on the first call, re-opened by the first call after it failed."""

    def __init__(self, stub, addr: str, on_failure=None, max_message_bytes: int = LANE_MESSAGE_BYTES,
                 client: str = "h2", keepalive: tuple[float, float] = KEEPALIVE) -> None:
        if client not in CLIENTS:
            raise ValueError(f"lane client {client!r}: one of {CLIENTS}")
        self.addr = addr
        self.max_message_bytes = max_message_bytes  # one lane message never exceeds it (lane_batches.py)
        self.fallback = stub  # the worker's own stub: its Lane method opens the stream; one RPC per call without it
        # the router's own HTTP/2 connection where the address is host:port; else the stub's (gRPC's resolver)
        self.client = client if host_port(addr) is not None else "grpc"
        self.path = lane_path(stub)
        self.keepalive = keepalive  # (time, timeout) of the h2 connection's pings, seconds
        # called with the status when the stream fails: the lane is a connection held open to the
        # worker, so a worker that dies is noticed at once (the pool probes it), calls or not
        self._on_failure = on_failure
        self._stream = None
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._out: list[wpb.LaneCall] = []
        self._out_sizes: list[int] = []
        self._wake: asyncio.Event | None = None
        self._flush_due = False  # a _flush_out is scheduled for this loop iteration
        self._writing = False  # the write loop is inside a write: later entries go through it, in order
        self._tasks: list[asyncio.Task] = []
        self.supported = True  # False once the worker answered UNIMPLEMENTED
        self.opened = 0  # streams opened (tests, logs)

    def start(self, call: _Call, entry: wpb.LaneCall) -> None:
        size = entry_bytes(entry)
        if size > self.max_message_bytes:
            # sent, it would fail the stream and every other call on it: this call alone fails
            call.fail(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the call is {size} bytes, over the lane's message limit of "
                                f"{self.max_message_bytes} bytes"))
            return
        self._calls[call.cid] = call
        self._send(entry, size)

    def cancel(self, call: _Call, tell_worker: bool = True) -> None:
        if self._calls.pop(call.cid, None) is not None and self._stream is not None and tell_worker:
            self._send(wpb.LaneCall(call=call.cid, cancel=True))

    def next_id(self) -> int:
        return next(self._ids)

    def _send(self, entry: wpb.LaneCall, size: int | None = None) -> None:
        if self._stream is None:
            self._open()
        self._out.append(entry)
        self._out_sizes.append(entry_bytes(entry) if size is None else size)
        if not self._flush_due:
            # every entry of this loop iteration goes out in one message, as the write loop sends them
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_out)

    def _flush_out(self) -> None:
        """The entries waiting, written at once where the stream takes them without waiting
        (H2Stream.try_write), else by the write loop: one task wake-up less per message on the
        router's hot path."""
        self._flush_due = False
        stream = self._stream
        if stream is None or not self._out:
            return  # the stream ended (its calls failed with it) or the write loop took them
        try_write = getattr(stream, "try_write", None)  # grpc.aio's stream has none: the loop writes
        if try_write is not None and not self._writing:
            out, sizes, self._out, self._out_sizes = self._out, self._out_sizes, [], []
            sent = 0
            try:
                for group in batches(out, sizes, self.max_message_bytes):
                    if not try_write(wpb.LaneUp(calls=group)):
                        break
                    sent += len(group)
            except Exception as e:  # noqa: BLE001 - as the write loop's own failure
                self._write_failed(stream, e)
                return
            if sent == len(out) or self._stream is not stream:
                return  # all written, or the stream ended meanwhile (its calls failed with it)
            # the rest waits for window: the write loop sends it, in order
            self._out, self._out_sizes = out[sent:], sizes[sent:]
        self._wake.set()

    def _open(self) -> None:
        md = ((TOKEN_KEY, internal_token()),) if internal_token() else None
        if self.client == "h2":
            stream = H2Stream(self.addr, self.path, wpb.LaneUp.SerializeToString, wpb.LaneDown.FromString, md or (),
                              max_message_bytes=MAX_MESSAGE_BYTES, keepalive_time=self.keepalive[0],
                              keepalive_timeout=self.keepalive[1], connect_timeout=sum(self.keepalive))
        else:
            stream = self.fallback.Lane(metadata=md)
        self._stream = stream
        on_messages = getattr(stream, "on_messages", None)  # grpc.aio's stream has none: the read loop reads
        if on_messages is not None:
            on_messages(functools.partial(self._dispatch, stream))
        self._wake = asyncio.Event()
        self.opened += 1
        self._tasks = [asyncio.ensure_future(self._write_loop(stream, self._wake)),
                       asyncio.ensure_future(self._read_loop(stream))]

    async def _write_loop(self, stream, wake: asyncio.Event) -> None:
        try:
            while True:
                await wake.wait()
                wake.clear()
                if self._stream is not stream:
                    return
                out, sizes, self._out, self._out_sizes = self._out, self._out_sizes, [], []
                self._writing = True
                try:
                    for group in batches(out, sizes, self.max_message_bytes):
                        await stream.write(wpb.LaneUp(calls=group))
                finally:
                    self._writing = False
        except Exception as e:  # noqa: BLE001 - a lane that cannot write must not hold its calls
            self._write_failed(stream, e)

    def _write_failed(self, stream, e: Exception) -> None:
        if isinstance(e, (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)):
            return  # the stream ended: the read loop fails its calls
        log.exception("lane write failed", worker=self.addr)
        self._closed(stream, rpc_error(grpc.StatusCode.UNAVAILABLE, f"lane to {self.addr}: write failed: {e!r}"))
        stream.cancel()

    async def _read_loop(self, stream) -> None:
        error: BaseException = rpc_error(grpc.StatusCode.UNAVAILABLE, f"lane to {self.addr} closed")
        try:
            while True:
                msg = await stream.read()  # only the end, where the stream hands messages to _dispatch
                if msg is grpc.aio.EOF:
                    break
                self._deliver(msg)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, f"lane to {self.addr} closed")
            raise
        finally:
            self._closed(stream, error)

    def _deliver(self, msg: wpb.LaneDown) -> None:
        calls = self._calls
        for reply in msg.replies:
            call = calls.get(reply.call)
            if call is not None:
                call.deliver(reply)
                if call.done:
                    del calls[reply.call]

    def _dispatch(self, stream, msg: wpb.LaneDown) -> None:
        """A message as the stream parses it (H2Stream.on_messages): delivered at once, with no
        wake-up of the read loop in between."""
        if self._stream is not stream:
            return
        try:
            self._deliver(msg)
        except Exception as e:  # noqa: BLE001 - as the read loop's own failure: the lane ends, its calls fail
            log.exception("lane read failed", worker=self.addr)
            self._closed(stream, rpc_error(grpc.StatusCode.UNAVAILABLE, f"lane to {self.addr}: read failed: {e!r}"))
            stream.cancel()

    def _closed(self, stream, error: BaseException) -> None:
        """The stream ended: its calls fail with its status (or move to per-call RPCs)."""
        if self._stream is not stream:
            return
        self._stream = None
        self._out, self._out_sizes = [], []
        self._wake.set()  # ends the write loop
        calls, self._calls = list(self._calls.values()), {}
        unimplemented = isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED
        if unimplemented:
            self.supported = False
            log.info("worker has no lane: one RPC per call", worker=self.addr)
        else:
            if calls:
                log.warning("lane failed", worker=self.addr, calls=len(calls), error=str(error)[:300])
            if self._on_failure is not None and isinstance(error, grpc.aio.AioRpcError):
                self._on_failure(error.code())
        for call in calls:
            if call.done:
                continue
            if unimplemented:
                call.fall_back(self.fallback)
            else:
                call.fail(error)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        for t in self._tasks:
            t.cancel()
        for call in list(self._calls.values()):
            call.fail(rpc_error(grpc.StatusCode.CANCELLED, "router closing"))
        self._calls.clear()


class LaneStub:
    """The worker's stub with Prefill / Decode on its lane (with --worker-lane false the pool's
    workers use RpcTransport, the bare stub, instead)."""

    def __init__(self, stub, addr: str, on_failure=None, max_message_bytes: int = LANE_MESSAGE_BYTES,
                 client: str = "h2", keepalive: tuple[float, float] = KEEPALIVE) -> None:
        self._stub = stub
        self.lane = Lane(stub, addr, on_failure, max_message_bytes, client, keepalive)

    def __getattr__(self, name):  # Load, Abort, and Prefill / Decode of a lane-less worker
        return getattr(self._stub, name)

    def _call(self, kind: str, call_type: type[_Call], request, timeout: float | None):
        lane = self.lane
        if not lane.supported:
            return getattr(self._stub, kind)(request, timeout=timeout)
        call = call_type(lane, lane.next_id(), request, timeout)
        lane.start(call, wpb.LaneCall(call=call.cid, timeout=timeout or 0.0, **{kind.lower(): request}))
        return call

    def Prefill(self, request: wpb.PrefillRequest, timeout: float | None = None):  # noqa: N802 - stub method
        return self._call("Prefill", LanePrefillCall, request, timeout)

    def Decode(self, request: wpb.DecodeRequest, timeout: float | None = None):  # noqa: N802 - stub method
        return self._call("Decode", LaneDecodeCall, request, timeout)
