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
from services.common.logging_setup import bound_room, get_logger
from services.common.prompt_logprobs import to_pb
from services.common.wire import top_logprobs_pb
from services.common.worker_servicer import WorkerServicer
from services.decode.jobs import coalesce
from services.decode.worker import DecodeFailed, DecodeWorker


def _check_prefill_addr(request) -> None:
    if request.colocated and request.prefill_addr:
        raise ValueError("a colocated request has no prefill_addr")
    if not request.colocated and not request.prefill_addr:
        raise ValueError("prefill_addr is required (or set colocated)")


class DecodeServicer(WorkerServicer, wpb_grpc.DecodeServicer):
    log = get_logger("decode.rpc")

    worker: DecodeWorker

    def __init__(self, worker: DecodeWorker, keepalive_interval: float = 1.0, log_requests: bool = True):
        super().__init__(worker, log_requests)
        self.keepalive_interval = keepalive_interval

    async def Decode(self, request, context):
        room = request.room
        with bound_room(room):
            ids = list(request.token_ids)
            # decode writes at least one token past the prompt into the room's pages
            job = await self.admit(
                request, context, ids, pages_for=len(ids) + 1, check=lambda: _check_prefill_addr(request),
                submit=lambda params: self.worker.submit(room, ids, params, request.prefill_addr, request.canary))
            if self.log_requests:
                self.log.info("decode request", prompt_tokens=len(ids), prefill=request.prefill_addr or "colocated")
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
                        if self.log_requests:
                            self.log.info("decode done", finish_reason=item.finish_reason,
                                          tokens=item.completion_tokens)
                        return
            finally:
                if not done:
                    # cancelled by the caller (client disconnect, stop string, router gone)
                    self.worker.abort(room, "Decode RPC cancelled by the caller")

    def load_fields(self) -> dict:
        return {"epoch": self.worker.receiver.epoch}
