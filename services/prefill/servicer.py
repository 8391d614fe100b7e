"""gRPC `Prefill` service: one RPC per room, answered when its KV has reached decode."""

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
from services.prefill.worker import PrefillWorker, RoomFailed
from services.transfer.state import DuplicateRoom

log = get_logger("prefill.rpc")


class PrefillServicer(LaneServicerMixin, wpb_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    async def Prefill(self, request, context):
        if refusing():  # stopping: the router fails this over at once
            await refuse(context, grpc.StatusCode.UNAVAILABLE, Refusal.DRAINING, refusing())
        room = request.room
        with bound_room(room):
            ids = list(request.token_ids)
            too_long = length_refusal(len(ids), request.params.max_tokens, self.worker.engine.config.max_model_len)
            if too_long:  # this worker's --max-model-len; another worker's may be longer: the router tries it
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.TOO_LONG, too_long)
            pool = self.worker.engine.pool
            try:
                params = parse_request(request.params, ids, self.worker.engine.config)
                if params.grammar is not None:  # a big grammar compiles for seconds: off the event loop
                    await asyncio.to_thread(self.worker.engine.check_grammar, params)
            except ValueError as e:
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.INVALID, str(e))
            if not pool.can_ever_hold(len(ids)):  # another worker's pool may: the router tries it (by this code)
                await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, Refusal.KV_CAPACITY,
                             f"prompt of {len(ids)} tokens needs more KV pages than this worker has")
            try:
                job = self.worker.submit(room, ids, params, request.share_key, request.canary)
            except DuplicateRoom as e:
                await refuse(context, grpc.StatusCode.ALREADY_EXISTS, Refusal.DUPLICATE_ROOM, str(e))
            log.info("prefill request", prompt_tokens=len(ids))
            try:
                result = await job.future
            except asyncio.CancelledError:
                # the caller went away (client disconnect, router restart): abort the room
                self.worker.abort(room, "Prefill RPC cancelled by the caller")
                raise
            except RoomFailed as e:
                log.info("prefill failed", reason=e.reason, code=e.code)
                await context.abort(getattr(grpc.StatusCode, e.code), f"room {room}: {e.reason}")
            log.info("prefill done", kv_bytes=result.kv_bytes, kv_seconds=round(result.kv_transfer_seconds, 6))
            reply = wpb.PrefillReply(
                room=room,
                first_token=result.first_token,
                first_logprob=result.first_logprob,
                prompt_tokens=result.prompt_tokens,
                kv_bytes=result.kv_bytes,
                kv_transfer_seconds=result.kv_transfer_seconds,
                first_top_logprobs=top_logprobs_pb([result.first_top])[0] if result.first_top else None,
                cached_tokens=result.cached_tokens,
            )
            if result.prompt_logprobs is not None:
                to_pb(result.prompt_logprobs, reply.prompt_logprobs)
            return reply

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
                             kv_capacity_tokens=engine.capacity_tokens, epoch=self.worker.sender.epoch,
                             prefix_cache_page_size=engine.pool.page_size if engine.prefix_cache else 0)

    async def ResetPrefixCache(self, request, context):
        dropped = self.worker.reset_prefix_cache()
        return wpb.ResetPrefixCacheReply(enabled=self.worker.engine.prefix_cache is not None, pages_dropped=dropped)
