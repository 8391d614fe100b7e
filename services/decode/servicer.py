"""gRPC `Decode` service: a server stream of token chunks per room.

While the worker holds a room but no forward is computing for it (waiting for pages, for
prefill, retracted, or beyond the batch limit), the stream carries a keep-alive chunk every
`keepalive_interval` seconds, so the router can tell a waiting decode from a frozen one: a
stream silent for longer than its --stream-stall-timeout means no progress (docs/router.md).

A chunk carries every token the room produced while the previous chunk was being written
(`coalesce`): a reader that keeps up gets one token per chunk, one that falls behind gets fewer,
bigger chunks instead of a growing backlog of messages.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.lane_server import LaneServicerMixin, refusing
from services.common.logging_setup import bound_room, get_logger
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION, incompatibility
from services.common.prompt_logprobs import to_pb
from services.common.refusal import Refusal, length_refusal, refuse
from services.common.wire import parse_request, top_logprobs_pb
from services.decode.jobs import coalesce
from services.decode.worker import DecodeFailed, DecodeWorker
from services.transfer.state import DuplicateRoom

log = get_logger("decode.rpc")


class DecodeServicer(LaneServicerMixin, wpb_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, keepalive_interval: float = 1.0):
        self.worker = worker
        self.keepalive_interval = keepalive_interval

    async def Decode(self, request, context):
        if refusing():  # stopping: the router fails this over at once
            await refuse(context, grpc.StatusCode.UNAVAILABLE, Refusal.DRAINING, refusing())
        room = request.room
        with bound_room(room):
            ids = list(request.token_ids)
            too_long = length_refusal(len(ids), request.params.max_tokens, self.worker.engine.config.max_model_len)
            if too_long:  # this worker's --max-model-len; another worker's may be longer: the router tries it
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.TOO_LONG, too_long)
            try:
                params = parse_request(request.params, ids, self.worker.engine.config)
                if params.grammar is not None:  # a big grammar compiles for seconds: off the event loop
                    await asyncio.to_thread(self.worker.engine.check_grammar, params)
                if request.colocated and request.prefill_addr:
                    raise ValueError("a colocated request has no prefill_addr")
                if not request.colocated and not request.prefill_addr:
                    raise ValueError("prefill_addr is required (or set colocated)")
                pool = self.worker.engine.pool
            except ValueError as e:
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.INVALID, str(e))
            if not pool.can_ever_hold(len(ids) + 1):  # another worker's pool may: the router tries it (by this code)
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.KV_CAPACITY,
                             f"prompt of {len(ids)} tokens needs more KV pages than this worker has")
            try:
                job = self.worker.submit(room, ids, params, request.prefill_addr, request.canary)
            except DuplicateRoom as e:
                await refuse(context, grpc.StatusCode.ALREADY_EXISTS, Refusal.DUPLICATE_ROOM, str(e))
            log.info("decode request", prompt_tokens=len(ids), prefill=request.prefill_addr or "colocated")
            done = False
            held = None  # a failure taken from the queue behind tokens: it ends the stream next
            try:
                while True:
                    if held is not None:
                        item, held = held, None
                    elif not job.out.empty():  # no timer when the next item is already there
                        item = job.out.get_nowait()
                    else:
                        try:
                            # not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands
                            # as the item arrives, and the room of a gone caller would decode on
                            async with asyncio.timeout(self.keepalive_interval):
                                item = await job.out.get()
                        except TimeoutError:
                            if not self.worker.is_computing(job):
                                yield wpb.DecodeChunk(keepalive=True, prompt_tokens=len(ids))
                            continue
                    if isinstance(item, DecodeFailed):
                        done = True
                        await context.abort(getattr(grpc.StatusCode, item.code), f"room {room}: {item.reason}")
                    # tokens produced while the previous chunk was being written go out together
                    item, held = coalesce(item, job.out)
                    chunk = wpb.DecodeChunk(
                        token_ids=item.token_ids,
                        logprobs=item.logprobs,
                        finish_reason=item.finish_reason,
                        prompt_tokens=len(ids),
                        completion_tokens=item.completion_tokens,
                        cached_tokens=job.usage_cached_tokens,
                        top_logprobs=top_logprobs_pb(item.top_logprobs),
                    )
                    if job.prompt_lp is not None:  # colocated: the first chunk carries them, once
                        to_pb(job.prompt_lp, chunk.prompt_logprobs)
                        job.prompt_lp = None
                    yield chunk
                    if item.finish_reason:
                        done = True
                        log.info("decode done", finish_reason=item.finish_reason, tokens=item.completion_tokens)
                        return
            finally:
                if not done:
                    # cancelled by the caller (client disconnect, stop string, router gone)
                    self.worker.abort(room, "Decode RPC cancelled by the caller")

    async def Abort(self, request, context):
        with bound_room(request.room):
            found = self.worker.abort(request.room, f"aborted: {request.reason or 'no reason given'}")
            log.info("abort", found=found, reason=request.reason)
            return wpb.AbortRoomReply(found=found)

    async def Load(self, request, context):
        problem = incompatibility("the router", request.protocol_version, request.min_protocol_version)
        if problem:
            log.error("router refused: incompatible protocol version", reason=problem)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        queued, running = self.worker.load()
        engine = self.worker.engine
        return wpb.LoadReply(queued=queued, running=running, token_usage=engine.pool.token_usage,
                             protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION,
                             kv_capacity_tokens=engine.capacity_tokens, max_model_len=engine.config.max_model_len,
                             epoch=self.worker.receiver.epoch,
                             prefix_cache_page_size=engine.pool.page_size if engine.prefix_cache else 0)

    async def ResetPrefixCache(self, request, context):
        dropped = self.worker.reset_prefix_cache()
        return wpb.ResetPrefixCacheReply(enabled=self.worker.engine.prefix_cache is not None, pages_dropped=dropped)
