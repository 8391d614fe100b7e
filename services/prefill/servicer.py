"""gRPC `Prefill` service: one RPC per room, answered when its KV has reached decode."""

from __future__ import annotations

import asyncio

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.logging_setup import bound_room, get_logger
from services.common.prompt_logprobs import to_pb
from services.common.wire import top_logprobs_pb
from services.common.worker_servicer import WorkerServicer
from services.prefill.worker import PrefillWorker, RoomFailed


class PrefillServicer(WorkerServicer, wpb_grpc.PrefillServicer):
    log = get_logger("prefill.rpc")

    worker: PrefillWorker

    async def Prefill(self, request, context):
        room = request.room
        with bound_room(room):
            ids = list(request.token_ids)
            job = await self.admit(
                request, context, ids, pages_for=len(ids),
                submit=lambda params: self.worker.submit(room, ids, params, request.share_key, request.canary))
            if self.log_requests:
                self.log.info("prefill request", prompt_tokens=len(ids))
            try:
                result = await job.future
            except asyncio.CancelledError:
                # the caller went away (client disconnect, router restart): abort the room
                self.worker.abort(room, "Prefill RPC cancelled by the caller")
                raise
            except RoomFailed as e:
                self.log.info("prefill failed", reason=e.reason, code=e.code)
                await context.abort(getattr(grpc.StatusCode, e.code), f"room {room}: {e.reason}")
            if self.log_requests:
                self.log.info("prefill done", kv_bytes=result.kv_bytes,
                              kv_seconds=round(result.kv_transfer_seconds, 6))
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

    def load_fields(self) -> dict:
        return {"epoch": self.worker.sender.epoch}
