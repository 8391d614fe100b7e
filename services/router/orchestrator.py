"""One request across one prefill and one decode worker, with one retry before the first token.

An `Attempt` issues `P.Prefill(room, ids)` and `D.Decode(room, P's address, ids)` at the same
time and reads decode's token stream:

- Until decode's first chunk arrives, each read races the Prefill RPC: if Prefill fails, the
  Decode RPC is cancelled and the attempt fails; if Decode fails, the Prefill RPC is cancelled.
  A cancelled RPC makes the worker abort the room.
- Once the first chunk has arrived, decode holds the whole KV cache (it reads the first token
  from the aux row that lands after the KV pages), so decode no longer needs prefill; a late
  Prefill failure is logged and does not break a healthy stream.
- When the stream ends, a Prefill RPC still in flight (its reply may trail the first token) is
  reaped in the background, bounded by the request deadline.
- Both RPCs carry the request deadline as their gRPC timeout, so nothing outlives it even when
  a worker is frozen.

`Orchestrator.generate()` picks a pair, runs an attempt and, if it fails before the first chunk
(i.e. before the client has seen a byte), runs one more attempt on another pair when one exists.
It yields `Chunk`s and raises `APIError` (503/504/400) on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.logging_setup import get_logger
from services.router.errors import APIError, bad_request, deadline_exceeded, upstream_failed
from services.router.pool import Worker, WorkerPool
from services.router.protocol import GenerateSpec

log = get_logger("router.orchestrator")

MAX_ROOM = (1 << 63) - 1
DEADLINE_SLACK = 0.05  # an RPC failing this close to the request deadline counts as the deadline


def new_room() -> int:
    """A random, non-zero 63-bit room id (also the request id in logs)."""
    while True:
        room = secrets.randbits(63)
        if room:
            return room


@dataclass
class Chunk:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "", "stop" or "length"


class WorkerFailure(Exception):
    def __init__(self, worker: Worker, code: grpc.StatusCode | None, details: str):
        super().__init__(f"{worker!r}: {code.name if code else 'ERROR'}: {details}")
        self.worker, self.code, self.details = worker, code, details


def sampling_pb(spec: GenerateSpec, eos_ids: Sequence[int]) -> wpb.SamplingParams:
    stop_ids = list(dict.fromkeys([*spec.stop_token_ids, *([] if spec.ignore_eos else eos_ids)]))
    return wpb.SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,
        max_tokens=spec.max_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=spec.ignore_eos,
    )


def retry_avoids(failure: WorkerFailure, prefill: Worker, decode: Worker) -> set[Worker]:
    """Workers the retry should avoid.

    A failure on decode's stream is decode's own (its process or its room): prefill is not
    suspect, and avoiding it would push the retry towards the other prefills, one of which may be
    dead and not yet ejected. A failure reported by prefill may be caused by either side (a KV
    transfer to a broken decode fails on prefill), so both are avoided.
    """
    if failure.worker is decode:
        return {decode}
    return {prefill, decode}


class Attempt:
    """Both RPCs of one try. The pair arrives reserved by WorkerPool.choose_pair; the attempt
    releases decode's slot on close and prefill's when the Prefill RPC ends."""

    def __init__(self, orch: Orchestrator, prefill: Worker, decode: Worker, room: int,
                 ids: list[int], params: wpb.SamplingParams, deadline: float):
        self.orch, self.prefill, self.decode, self.room = orch, prefill, decode, room
        self.deadline = deadline
        loop = asyncio.get_running_loop()
        timeout = max(0.001, deadline - loop.time())
        self._prefill_call = prefill.stub.Prefill(
            wpb.PrefillRequest(room=room, token_ids=ids, params=params), timeout=timeout
        )
        self._decode_call = decode.stub.Decode(
            wpb.DecodeRequest(room=room, prefill_addr=prefill.addr, token_ids=ids, params=params), timeout=timeout
        )
        self._prefill_task = asyncio.ensure_future(self._run_prefill())
        self._prefill_task.add_done_callback(self._prefill_done)
        self._read: asyncio.Future | None = None
        self.got_first = False
        self._closed = False

    async def _run_prefill(self) -> wpb.PrefillReply:
        return await self._prefill_call

    def _prefill_done(self, task: asyncio.Task) -> None:
        self.prefill.inflight -= 1
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.got_first:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
            log.warning("prefill failed after decode had the KV; stream continues", room=self.room,
                        prefill=self.prefill.addr, error=str(exc)[:300])
            self.orch.pool.report_failure(self.prefill, code)

    def _prefill_failure(self) -> WorkerFailure | None:
        task = self._prefill_task
        if not task.done():
            return None
        if task.cancelled():
            return WorkerFailure(self.prefill, grpc.StatusCode.CANCELLED, "Prefill RPC cancelled")
        exc = task.exception()
        if exc is None:
            return None
        if isinstance(exc, grpc.aio.AioRpcError):
            return WorkerFailure(self.prefill, exc.code(), exc.details() or "")
        return WorkerFailure(self.prefill, None, repr(exc))

    async def next(self) -> Chunk | None:
        """The next chunk from decode, or None at the end of the stream. Raises WorkerFailure."""
        while not self.got_first and not self._prefill_task.done():
            if self._read is None:
                self._read = asyncio.ensure_future(self._decode_call.read())
            await asyncio.wait({self._read, self._prefill_task}, return_when=asyncio.FIRST_COMPLETED)
            if self._read.done():
                read, self._read = self._read, None
                return self._chunk(read)
        failure = None if self.got_first else self._prefill_failure()
        if failure is not None:
            raise failure
        if self._read is not None:
            read, self._read = self._read, None
            await asyncio.wait({read})
            return self._chunk(read)
        try:
            msg = await self._decode_call.read()
        except grpc.aio.AioRpcError as e:
            raise WorkerFailure(self.decode, e.code(), e.details() or "") from None
        return self._convert(msg)

    def _chunk(self, read: asyncio.Future) -> Chunk | None:
        if read.cancelled():
            raise WorkerFailure(self.decode, grpc.StatusCode.CANCELLED, "Decode read cancelled")
        exc = read.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            raise WorkerFailure(self.decode, exc.code(), exc.details() or "")
        if exc is not None:
            raise WorkerFailure(self.decode, None, repr(exc))
        return self._convert(read.result())

    def _convert(self, msg) -> Chunk | None:
        if msg is grpc.aio.EOF:
            return None
        self.got_first = True
        return Chunk(list(msg.token_ids), list(msg.logprobs), msg.finish_reason)

    def close(self, completed: bool = False) -> None:
        """End both RPCs (idempotent). Called on success, failure, stop string and disconnect.

        completed: decode finished the stream; a Prefill reply still on its way is then awaited in
        the background (bounded by the deadline). Otherwise the Prefill RPC is cancelled too.
        """
        if self._closed:
            return
        self._closed = True
        if self._read is not None and not self._read.done():
            self._read.cancel()
        self._decode_call.cancel()  # no-op when the stream already finished
        self.decode.inflight -= 1
        if not self._prefill_task.done():
            if completed:
                self.orch.reap(self._prefill_task, self._prefill_call, self.deadline)
            else:
                self._prefill_call.cancel()
                self._prefill_task.cancel()


class Orchestrator:
    def __init__(self, pool: WorkerPool, eos_ids: Sequence[int]):
        self.pool = pool
        self.eos_ids = list(eos_ids)
        self._reapers: set[asyncio.Task] = set()

    def reap(self, task: asyncio.Task, call, deadline: float) -> None:
        async def wait() -> None:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                call.cancel()
                task.cancel()
            except BaseException:  # noqa: BLE001 - its outcome is logged by the attempt
                pass

        reaper = asyncio.ensure_future(wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)

    async def close(self) -> None:
        for t in list(self._reapers):
            t.cancel()
        for t in list(self._reapers):
            with contextlib.suppress(BaseException):
                await t

    def _error(self, failure: WorkerFailure, deadline: float, timeout: float) -> tuple[APIError, bool]:
        """The client-facing error for a failed attempt, and whether another attempt may help."""
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline - DEADLINE_SLACK:
            return deadline_exceeded(timeout), False
        if failure.code == grpc.StatusCode.INVALID_ARGUMENT:
            return bad_request(f"The worker rejected the request: {failure.details}", code="invalid_request"), False
        return upstream_failed(f"{failure.worker.role} {failure.worker.addr}: "
                               f"{failure.code.name if failure.code else 'ERROR'}: {failure.details}"), True

    async def generate(
        self, spec: GenerateSpec, deadline: float, timeout: float, first_room: int | None = None
    ) -> AsyncIterator[Chunk]:
        """Chunks of one request; raises APIError. Close it (aclose) to cancel the RPCs.

        The first attempt uses `first_room` (the request id) when given; a retry gets a new room.
        """
        loop = asyncio.get_running_loop()
        params = sampling_pb(spec, self.eos_ids)
        exclude: set[Worker] = set()
        attempt: Attempt | None = None
        completed = False
        try:
            for number in (1, 2):
                if loop.time() >= deadline:
                    raise deadline_exceeded(timeout)
                prefill, decode = await self.pool.choose_pair(exclude)
                room = first_room if number == 1 and first_room else new_room()
                with structlog.contextvars.bound_contextvars(room=room):
                    try:
                        attempt = Attempt(self, prefill, decode, room, spec.prompt_ids, params, deadline)
                    except BaseException:
                        prefill.inflight -= 1
                        decode.inflight -= 1
                        raise
                    log.info("attempt", attempt=number, prefill=prefill.addr, decode=decode.addr,
                             prompt_tokens=len(spec.prompt_ids), max_tokens=spec.max_tokens)
                    try:
                        first = await attempt.next()
                        if first is None:
                            raise WorkerFailure(decode, None, "decode stream ended before the first token")
                        break
                    except WorkerFailure as failure:
                        attempt.close()
                        self.pool.report_failure(failure.worker, failure.code)
                        error, retryable = self._error(failure, deadline, timeout)
                        log.warning("attempt failed", attempt=number, error=str(failure)[:500],
                                    status=error.status, retry=retryable and number == 1)
                        if not retryable or number == 2:
                            raise error from None
                        exclude |= retry_avoids(failure, prefill, decode)
            completed = bool(first.finish_reason)
            yield first
            if completed:
                return
            while True:
                try:
                    chunk = await attempt.next()
                except WorkerFailure as failure:
                    self.pool.report_failure(failure.worker, failure.code)
                    error, _ = self._error(failure, deadline, timeout)
                    log.warning("stream failed", room=attempt.room, error=str(failure)[:500], status=error.status)
                    raise error from None
                if chunk is None:
                    log.warning("decode stream ended without a finish reason", room=attempt.room)
                    raise upstream_failed("the decode stream ended without a finish reason")
                completed = bool(chunk.finish_reason)
                yield chunk
                if completed:
                    return
        finally:
            if attempt is not None:
                attempt.close(completed)
