"""One attempt: a Prefill RPC and a Decode stream on one (prefill, decode) pair, bound to both.

`Attempt.next()` returns decode's next chunk of tokens and raises `WorkerFailure` the moment
the attempt can no longer succeed:

- the Decode stream fails (`kind="error"`), or ends without a finish reason (`"ended"`);
- before decode's first token: the Prefill RPC fails (decode still needs its KV);
- the pool ejects the decode, or (before the first token) the prefill (`"ejected"`): the router
  never waits on a worker it already knows is unhealthy;
- the Decode stream is silent — no chunk of any kind, tokens or keep-alive — for longer than
  `stall_timeout` (`"stalled"`). A decode that legitimately cannot step a room it holds
  (waiting for KV pages, for prefill's forward or transfer, retracted) sends a keep-alive
  chunk (no tokens) every second or so; a running room sends tokens. So silence means a frozen
  or wedged decode, whatever its TCP connection says.

Once decode's first token is in, decode holds the whole KV cache (the first token comes from the
aux row that lands after the KV pages), so a late Prefill failure or ejection no longer matters.
Both RPCs carry the request deadline as their gRPC timeout; `close()` cancels what is still
open, which makes the workers abort the room.

Colocated mode (router --mode colocated): `prefill` is None, there is no Prefill RPC, and the
Decode request asks decode to compute the prompt itself; everything else is the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.logging_setup import get_logger
from services.common.prompt_logprobs import PromptLogprobs, from_pb
from services.common.refusal import Refusal, refusal_of
from services.router.leases import PairLease
from services.router.pool import WorkerHandle, WorkerPool

log = get_logger("router.attempt")
# how long the first token waits for prefill's reply to report its top_logprobs alternatives
FIRST_TOP_WAIT_S = 2.0


@dataclass
class Chunk:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "", "stop" or "length"
    # per token, the top_logprobs alternatives [(id, logprob)], most likely first; None: not asked for
    top: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0  # prompt tokens a worker found in its prefix cache (usage's cached_tokens)
    prompt: PromptLogprobs | None = None  # on an attempt's first chunk, when prompt logprobs were asked for


class WorkerFailure(Exception):
    """An attempt that cannot succeed. kind: error | ejected | stalled | ended; `refusal`: the
    worker's reason when it refused the call (services/common/refusal.py)."""

    def __init__(self, worker: WorkerHandle, code: grpc.StatusCode | None, details: str, kind: str = "error",
                 refusal: Refusal = Refusal.UNSPECIFIED):
        super().__init__(f"{worker!r}: {code.name if code else kind.upper()}: {details}")
        self.worker, self.code, self.details, self.kind, self.refusal = worker, code, details, kind, refusal


def rpc_failure(worker: WorkerHandle, exc: BaseException) -> WorkerFailure:
    if isinstance(exc, grpc.aio.AioRpcError):
        return WorkerFailure(worker, exc.code(), exc.details() or "", refusal=refusal_of(exc))
    if isinstance(exc, asyncio.CancelledError):
        return WorkerFailure(worker, grpc.StatusCode.CANCELLED, "RPC cancelled")
    return WorkerFailure(worker, None, repr(exc))


async def first_of(futures: set[asyncio.Future], until: float) -> None:
    """Return once one of `futures` is done or the loop's clock reaches `until`: asyncio.wait's
    FIRST_COMPLETED with a deadline, for one caller, with one waiter and one timer and no sets
    (it runs for every chunk of every stream)."""
    loop = asyncio.get_running_loop()
    for f in futures:
        if f.done():
            return
    waiter = loop.create_future()

    def wake(_=None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for f in futures:
        f.add_done_callback(wake)
    timer = loop.call_at(until, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        for f in futures:
            f.remove_done_callback(wake)


# what `wait_read` sets a read's future to when something else woke it: not a message
WOKEN = object()


async def wait_read(read: asyncio.Future, others: list[asyncio.Future], until: float) -> None:
    """first_of((read, *others), until), where `read` is a plain future the caller owns (a lane
    call's `read()`): the other wake-ups and the timer set `read` itself (to WOKEN), so a chunk
    wakes the waiting task directly instead of through a callback and a second future. Its
    producer takes a `read` already done as a reader gone, and keeps the chunk for the next one."""
    if isinstance(read, asyncio.Task) or not isinstance(read, asyncio.Future):
        await first_of({read, *others}, until)
        return
    for f in others:
        if f.done():
            return

    def wake(_=None) -> None:
        if not read.done():
            read.set_result(WOKEN)

    for f in others:
        f.add_done_callback(wake)
    timer = asyncio.get_running_loop().call_at(until, wake)
    try:
        await read
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():
            raise  # this task was cancelled
        # else the read itself was (its call ended so): the caller reads that from it, as a failure
    except Exception:  # noqa: BLE001, S110 - the read's failure: the caller reads it from the read
        pass
    finally:
        timer.cancel()
        for f in others:
            f.remove_done_callback(wake)


class Attempt:
    """Both RPCs of one try, and nothing else: what to do when it fails is the orchestrator's
    (services/router/recovery_policy.py). The pair arrives reserved (a PairLease from
    WorkerPool.choose_pair); the attempt releases decode's lease on close and prefill's when the
    Prefill RPC ends (releases are idempotent, so the orchestrator may release the pair again)."""

    def __init__(
        self,
        pool: WorkerPool,
        reap: Callable[[asyncio.Future, object, float], None],
        pair: PairLease,
        room: int,
        ids: list[int],
        params: wpb.SamplingParams,
        deadline: float,
        stall_timeout: float,
        share_key: int = 0,
        canary: bool = False,
    ):
        self.pool, self._reap = pool, reap
        self.pair = pair
        prefill, decode = self.prefill, self.decode = pair.prefill, pair.decode
        self.room = room
        self.deadline, self.stall_timeout = deadline, stall_timeout
        self.top_logprobs = params.top_logprobs
        self.wants_prompt = params.HasField("prompt_logprobs")
        loop = asyncio.get_running_loop()
        timeout = max(0.001, deadline - loop.time())
        # the workers' transports (services/router/transport.py): grpc.aio-shaped calls, over a
        # lane or one RPC each
        self._prefill_call = None if prefill is None else prefill.transport.prefill(
            wpb.PrefillRequest(room=room, token_ids=ids, params=params, share_key=share_key, canary=canary),
            timeout,
        )
        self._decode_call = decode.transport.decode(
            wpb.DecodeRequest(room=room, prefill_addr=prefill.addr if prefill else "", token_ids=ids, params=params,
                              colocated=prefill is None, canary=canary),
            timeout,
        )
        self._prefill_reply = self._prefill_future(loop)
        self._prefill_reply.add_done_callback(self._prefill_done)
        self._read: asyncio.Future | None = None
        self._down: set[WorkerHandle] = set()  # this attempt's workers the pool has ejected
        self._ejected: asyncio.Future = loop.create_future()  # wakes next() when _down grows
        self._unwatch = pool.watch(self._on_ejected)
        self._last_heard = loop.time()  # the stall clock: last chunk of any kind (or the start)
        self.got_first = False  # decode has sent a token: the client may have seen bytes of this attempt
        self._closed = False

    def _prefill_future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """The Prefill reply as a future: a lane call's own (no task per request), a task around
        any other call, already None without prefill."""
        call = self._prefill_call
        if call is None:
            done = loop.create_future()
            done.set_result(None)
            return done
        future = getattr(call, "future", None)
        return future if isinstance(future, asyncio.Future) else asyncio.ensure_future(self._run_prefill())

    async def _run_prefill(self) -> wpb.PrefillReply | None:
        return await self._prefill_call

    def _prefill_done(self, task: asyncio.Future) -> None:
        if self.prefill is None:
            return
        self.pair.release_prefill()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.got_first:
            failure = rpc_failure(self.prefill, exc)
            log.warning("prefill failed after decode had the KV; stream continues", room=self.room,
                        prefill=self.prefill.addr, error=str(failure)[:300])
            self.pool.report_failure(self.prefill, failure.code)

    def _on_ejected(self, worker: WorkerHandle) -> None:
        if worker is self.decode or worker is self.prefill:
            self._down.add(worker)
            if not self._ejected.done():
                self._ejected.set_result(None)

    async def next(self) -> Chunk | None:
        """The next chunk with tokens, or None at the end of the stream. Raises WorkerFailure."""
        loop = asyncio.get_running_loop()
        while True:
            if self._read is None:
                self._read = asyncio.ensure_future(self._decode_call.read())
            stall_at = self._last_heard + self.stall_timeout
            if not self._read.done():  # a chunk already in hand is taken without waiting on anything
                others = [self._ejected]
                if not self.got_first and not self._prefill_reply.done():
                    others.append(self._prefill_reply)
                await wait_read(self._read, others, stall_at)
            if self._read.done():
                read, self._read = self._read, None
                if read.cancelled() or read.exception() is not None:
                    raise rpc_failure(self.decode, asyncio.CancelledError() if read.cancelled() else read.exception())
                msg = read.result()
                if msg is grpc.aio.EOF:
                    return None
                # WOKEN: another wake-up (below) came first; a chunk that came meanwhile waits for the next read
                if msg is not WOKEN:
                    self._last_heard = loop.time()
                    if not msg.token_ids and not msg.finish_reason:
                        continue  # a keep-alive: decode holds the room and is alive
                    return await self._chunk(msg)
            if self._ejected.done():
                if self.decode in self._down or not self.got_first:
                    worker = self.decode if self.decode in self._down else self.prefill
                    raise WorkerFailure(worker, None, "ejected by the worker pool (failed health checks)",
                                        kind="ejected")
                # only prefill was ejected, after decode got the KV: no longer this attempt's concern
                self._down.discard(self.prefill)
                self._ejected = loop.create_future()
            if not self.got_first and self._prefill_reply.done():
                failure = self._prefill_failure()
                if failure is not None:
                    raise failure
                # prefill replied; decode's first token is on its way (the stall clock still runs)
            if loop.time() >= stall_at:
                raise WorkerFailure(self.decode, None, f"no chunk for {self.stall_timeout:g} s", kind="stalled")

    async def _chunk(self, msg: wpb.DecodeChunk) -> Chunk:
        first = not self.got_first
        chunk = Chunk(list(msg.token_ids), list(msg.logprobs), msg.finish_reason, cached_tokens=msg.cached_tokens)
        if first and self.wants_prompt:
            # before got_first: without them the attempt fails over, nothing was sent yet
            chunk.prompt = await self._prompt_logprobs(msg)
        self.got_first = True
        if self.top_logprobs:
            chunk.top = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in msg.top_logprobs]
            if first and len(chunk.top) < len(chunk.token_ids):
                chunk.top.insert(0, await self._first_top())
        return chunk

    async def _prompt_logprobs(self, msg: wpb.DecodeChunk) -> PromptLogprobs:
        """The prompt's logprobs: colocated, on decode's first chunk; else in prefill's reply, which
        follows the KV transfer decode just saw end. Waited for within the stall timeout (they
        are part of the answer, unlike _first_top's best effort); a reply without them (a worker
        of an older release, which ignores the field) fails the attempt."""
        if self._prefill_call is None:
            if not msg.HasField("prompt_logprobs"):
                raise WorkerFailure(self.decode, None, "decode sent no prompt logprobs", kind="error")
            return from_pb(msg.prompt_logprobs)
        task = self._prefill_reply
        await asyncio.wait((task,), timeout=self.stall_timeout)
        if not task.done():
            raise WorkerFailure(self.prefill, None, f"no prefill reply for {self.stall_timeout:g} s", kind="stalled")
        failure = self._prefill_failure()
        if failure is not None:
            raise failure
        reply = task.result()
        if not reply.HasField("prompt_logprobs"):
            raise WorkerFailure(self.prefill, None, "prefill sent no prompt logprobs", kind="error")
        return from_pb(reply.prompt_logprobs)

    async def _first_top(self) -> list[tuple[int, float]]:
        """The first token's alternatives: prefill sampled it and reports them in its reply, which
        follows the KV transfer decode just saw end. Waits briefly for it; without it the first
        token lists no alternatives rather than holding the stream."""
        if self._prefill_call is None:
            return []
        # asyncio.wait, not wait_for around a shield: a cancel of this task (client gone) must
        # propagate, whatever became of the Prefill call
        task = self._prefill_reply
        await asyncio.wait((task,), timeout=FIRST_TOP_WAIT_S)
        if not task.done() or task.cancelled() or task.exception() is not None:
            return []
        reply = task.result()
        top = reply.first_top_logprobs if reply is not None else None
        return list(zip(top.token_ids, top.logprobs, strict=True)) if top is not None else []

    def _prefill_failure(self) -> WorkerFailure | None:
        task = self._prefill_reply
        if task.cancelled():
            return WorkerFailure(self.prefill, grpc.StatusCode.CANCELLED, "Prefill RPC cancelled")
        exc = task.exception()
        return None if exc is None else rpc_failure(self.prefill, exc)

    def close(self, completed: bool = False) -> None:
        """End both RPCs (idempotent). Called on success, failure, stop string and disconnect.

        completed: decode finished the stream; a Prefill reply still on its way is then awaited in
        the background (bounded by the deadline). Otherwise the Prefill RPC is cancelled too.
        """
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        if self._read is not None and not self._read.done():
            self._read.cancel()
        self._decode_call.cancel()  # no-op when the stream already finished
        self.pair.release_decode()
        if not self._prefill_reply.done():
            if completed:
                self._reap(self._prefill_reply, self._prefill_call, self.deadline)
            else:
                if self._prefill_call is not None:
                    self._prefill_call.cancel()
                self._prefill_reply.cancel()
