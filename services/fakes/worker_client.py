"""A small client that drives one request through prefill and decode over real gRPC, the way
the router does: Prefill and Decode issued at the same time with the same room id."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb


def new_room() -> int:
    return random.getrandbits(63)


@dataclass
class Outcome:
    room: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    prefill_error: grpc.aio.AioRpcError | None = None
    decode_error: grpc.aio.AioRpcError | None = None
    prefill_reply: wpb.PrefillReply | None = None

    @property
    def ok(self) -> bool:
        return self.prefill_error is None and self.decode_error is None and bool(self.finish_reason)


async def generate(
    prefill_addr: str,
    decode_addr: str,
    token_ids: list[int],
    params: SamplingParams,
    room: int | None = None,
    timeout: float = 60,
    cancel_on_failure: bool = True,
    share_key: int = 0,
) -> Outcome:
    """cancel_on_failure=False leaves the other RPC running when one fails, so a test can see
    the worker end it on its own (heartbeat, deadline) instead of by cancellation. share_key:
    PrefillRequest.share_key (the n choices of one router request share one)."""
    room = new_room() if room is None else room
    out = Outcome(room)
    async with channel(prefill_addr) as pch, channel(decode_addr) as dch:
        p_stub, d_stub = wpb_grpc.PrefillStub(pch), wpb_grpc.DecodeStub(dch)
        pb_params = params_to_pb(params)

        async def do_prefill():
            try:
                out.prefill_reply = await p_stub.Prefill(
                    wpb.PrefillRequest(room=room, token_ids=token_ids, params=pb_params, share_key=share_key),
                    timeout=timeout,
                )
            except grpc.aio.AioRpcError as e:
                out.prefill_error = e

        async def do_decode():
            try:
                stream = d_stub.Decode(
                    wpb.DecodeRequest(room=room, prefill_addr=prefill_addr, token_ids=token_ids, params=pb_params),
                    timeout=timeout,
                )
                async for chunk in stream:
                    out.tokens.extend(chunk.token_ids)
                    out.logprobs.extend(chunk.logprobs)
                    if chunk.finish_reason:
                        out.finish_reason = chunk.finish_reason
            except grpc.aio.AioRpcError as e:
                out.decode_error = e

        # As the router does: a failed Prefill cancels the Decode RPC and vice versa.
        p_task, d_task = asyncio.ensure_future(do_prefill()), asyncio.ensure_future(do_decode())
        pending = {p_task, d_task}
        while pending:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task, failed in ((d_task, out.prefill_error), (p_task, out.decode_error)):
                if cancel_on_failure and failed is not None and task in pending:
                    task.cancel()
        await asyncio.gather(p_task, d_task, return_exceptions=True)
    return out
