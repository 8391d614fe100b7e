"""The worker's end of the lane: Prefill / Decode calls multiplexed over one bidirectional stream.

The router opens one `Lane` stream per worker and sends every call on it (proto LaneCall); a new
gRPC call costs the router's single event loop 150-250 µs of CPU in grpc.aio, a lane message a
few µs, and one message carries every entry that was ready when it was written.

Each call runs the servicer's own `Prefill` / `Decode` method, unchanged, in a task of its own,
with a context whose `abort` ends the call with that status, as grpc's would:

- a Prefill call answers its reply (which ends it) or a LaneEnd with the abort's status;
- a Decode call answers its chunks, then a LaneEnd (OK after the finish reason);
- a `cancel` entry, the call's timeout, or the end of the stream (router gone, connection lost)
  cancels the task, which is what grpc does to an RPC's handler: the servicer's own
  cancellation path aborts the room.

A Decode call's next chunk is taken from the servicer only once the message holding its last
one was written, as on a stream of its own, so a reader that falls behind gets bigger chunks
(the servicer's coalescing) instead of a growing queue.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.lane_batches import LANE_MESSAGE_BYTES, batches, entry_bytes
from services.common.logging_setup import get_logger
from services.common.refusal import Refusal, refusal_from_metadata

log = get_logger("lane")


class LaneAbort(Exception):
    """Raised by LaneContext.abort: ends the call with this status."""

    def __init__(self, code: grpc.StatusCode, details: str, refusal: int = 0):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.refusal = code, details, refusal


class LaneContext:
    """What pdmesh's servicers use of grpc's ServicerContext, for a call on a lane."""

    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        # the refusal code (services/common/refusal.py) is the only trailing metadata a servicer sets
        raise LaneAbort(code, details, refusal_from_metadata(trailing_metadata))


_CONTEXT = LaneContext()

# The process is stopping (graceful stop): a call that arrives on a lane already open gets
# UNAVAILABLE at once, as a new RPC does once the gRPC server stops, so the router fails it over
# right away instead of its running into the end of the stop's grace period. One worker per process.
_refusing = ""


def refuse_new_calls(reason: str) -> None:
    """From now on, answer every new lane call with UNAVAILABLE: `reason` ("" accepts again)."""
    global _refusing
    _refusing = reason


def refusing() -> str:
    """Why new calls are refused ("" while they are accepted): a stopping worker refuses new
    Prefill / Decode calls made outside a lane too, while it drains the rooms it holds."""
    return _refusing


def _end(call: int, code: grpc.StatusCode, details: str = "", refusal: int = 0) -> wpb.LaneReply:
    return wpb.LaneReply(call=call, end=wpb.LaneEnd(code=code.value[0], details=details, refusal=refusal))


class _LaneStream:
    """One open Lane stream: its calls' tasks and the batch of replies waiting to be written."""

    def __init__(self, servicer, context, max_message_bytes: int = LANE_MESSAGE_BYTES) -> None:
        self.servicer, self.context = servicer, context
        self.max_message_bytes = max_message_bytes  # one lane message never exceeds it (lane_batches.py)
        self.loop = asyncio.get_running_loop()
        self.tasks: dict[int, asyncio.Task] = {}
        self.out: list[wpb.LaneReply] = []
        self.batch: asyncio.Future | None = None  # done once `out` as it is now has been written
        self.writing: asyncio.Future | None = None  # the batch being written
        self.wake = asyncio.Event()

    def emit(self, reply: wpb.LaneReply) -> asyncio.Future:
        """Queue a reply; returns the future of the message that will carry it."""
        self.out.append(reply)
        if self.batch is None:
            self.batch = self.loop.create_future()
            self.wake.set()
        return self.batch

    async def write_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            out, self.writing = self.out, self.batch
            self.out, self.batch = [], None
            try:
                out, sizes = self._fitting(out)
                for group in batches(out, sizes, self.max_message_bytes):
                    await self.context.write(wpb.LaneDown(replies=group))
            finally:
                if self.writing is not None and not self.writing.done():
                    self.writing.set_result(None)
                self.writing = None

    def _fitting(self, out: list[wpb.LaneReply]) -> tuple[list[wpb.LaneReply], list[int]]:
        """The replies with their sizes; one too big for any message becomes its call's end
        (RESOURCE_EXHAUSTED) and the call is cancelled, so the stream and its other calls go on."""
        sizes = [entry_bytes(r) for r in out]
        for i, size in enumerate(sizes):
            if size > self.max_message_bytes:
                call = out[i].call
                log.warning("lane reply over the message limit", call=call, bytes=size, limit=self.max_message_bytes)
                task = self.tasks.get(call)
                if task is not None:
                    task.cancel()
                out[i] = _end(call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the reply is {size} bytes, over the lane's message limit of {self.max_message_bytes} bytes")
                sizes[i] = entry_bytes(out[i])
        return out, sizes

    def start(self, entry: wpb.LaneCall) -> None:
        op = entry.WhichOneof("op")
        if op == "cancel":
            task = self.tasks.get(entry.call)
            if task is not None:
                task.cancel()
            return
        if _refusing:
            self.emit(_end(entry.call, grpc.StatusCode.UNAVAILABLE, _refusing, Refusal.DRAINING))
            return
        if entry.call in self.tasks:
            self.emit(_end(entry.call, grpc.StatusCode.ALREADY_EXISTS, f"lane call {entry.call} is in progress"))
            return
        if op == "prefill" and hasattr(self.servicer, "Prefill"):
            run = self._prefill(entry.call, entry.prefill)
        elif op == "decode" and hasattr(self.servicer, "Decode"):
            run = self._decode(entry.call, entry.decode)
        else:
            self.emit(_end(entry.call, grpc.StatusCode.UNIMPLEMENTED, f"no {op or 'empty'} call on this lane"))
            return
        task = self.loop.create_task(run)
        self.tasks[entry.call] = task
        timer = self.loop.call_later(entry.timeout, task.cancel) if entry.timeout > 0 else None
        task.add_done_callback(lambda _t, call=entry.call: self._finished(call, timer))

    def _finished(self, call: int, timer: asyncio.TimerHandle | None) -> None:
        self.tasks.pop(call, None)
        if timer is not None:
            timer.cancel()

    async def _prefill(self, call: int, request: wpb.PrefillRequest) -> None:
        try:
            reply = await self.servicer.Prefill(request, _CONTEXT)
        except LaneAbort as e:
            self.emit(_end(call, e.code, e.details, e.refusal))
        except Exception as e:  # as grpc answers a handler's exception: UNKNOWN, the error named
            log.exception("lane prefill call failed", call=call)
            self.emit(_end(call, grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"))
        else:
            self.emit(wpb.LaneReply(call=call, prefill=reply))  # a reply ends a Prefill call

    async def _decode(self, call: int, request: wpb.DecodeRequest) -> None:
        chunks = self.servicer.Decode(request, _CONTEXT)
        try:
            async for chunk in chunks:
                # the message's future is shared by every call in it: cancelling this call while
                # it waits must not cancel the others' wait (await the future itself and it would)
                await asyncio.shield(self.emit(wpb.LaneReply(call=call, chunk=chunk)))
            self.emit(_end(call, grpc.StatusCode.OK))
        except LaneAbort as e:
            self.emit(_end(call, e.code, e.details, e.refusal))
        except asyncio.CancelledError:
            # cancelled while waiting for a write: the servicer sits at its yield; it sees the
            # cancellation there, as when grpc cancels an RPC's handler
            with contextlib.suppress(BaseException):
                await chunks.athrow(asyncio.CancelledError())
            raise
        except Exception as e:
            log.exception("lane decode call failed", call=call)
            self.emit(_end(call, grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"))
        finally:
            await chunks.aclose()

    async def serve(self, request_iterator) -> None:
        writer = self.loop.create_task(self.write_loop())
        try:
            async for up in request_iterator:
                for entry in up.calls:
                    self.start(entry)
            # the router closed its side: let the calls in progress finish, then end the stream
            while self.tasks:
                await asyncio.wait(list(self.tasks.values()))
            for batch in (self.writing, self.batch):
                if batch is not None:
                    await asyncio.shield(batch)
        finally:
            for task in list(self.tasks.values()):
                task.cancel()
            for task in list(self.tasks.values()):
                try:
                    await task
                except BaseException:  # noqa: BLE001 - each call's outcome is its own
                    pass
            writer.cancel()


class LaneServicerMixin:
    """Gives a Prefill or Decode servicer the `Lane` method (put it first among the bases)."""

    async def Lane(self, request_iterator, context):  # noqa: N802 - gRPC method name
        await _LaneStream(self, context).serve(request_iterator)
