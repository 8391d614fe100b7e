"""Run inside a namespace that does not hold the internal token (`ip netns exec`): call every
internal gRPC method of a prefill and a decode without the token, and play a router for one
live room (with the token, given on the command line) while an intruder's Attach for that room
is refused. Prints one JSON object.

    python -m tests.hosts.internal_probe PREFILL_ADDR DECODE_ADDR TOKEN
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.generated.pdmesh.v1 import bootstrap_pb2 as bpb
from services.common.generated.pdmesh.v1 import bootstrap_pb2_grpc as bpb_grpc
from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.transfer.wire_format import PROTOCOL_VERSION


async def code_of(coro) -> str:
    try:
        r = await coro
        if hasattr(r, "__aiter__"):
            async for _ in r:
                pass
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def main(prefill: str, decode: str, token: str) -> dict:
    out: dict = {"no_token": {}}
    params = params_to_pb(SamplingParams(temperature=0.0, max_tokens=4))
    ids = list(range(40, 80))
    async with channel(prefill, token="") as pch, channel(decode, token="") as dch:
        p, d, b = wpb_grpc.PrefillStub(pch), wpb_grpc.DecodeStub(dch), bpb_grpc.KVBootstrapStub(pch)
        room = random.getrandbits(63)
        calls = {
            "Prefill.Prefill": p.Prefill(wpb.PrefillRequest(room=room, token_ids=ids, params=params), timeout=5),
            "Prefill.Abort": p.Abort(wpb.AbortRoomRequest(room=room, reason="intruder"), timeout=5),
            "Prefill.Load": p.Load(wpb.LoadRequest(), timeout=5),
            "Decode.Decode": _drain(d.Decode(wpb.DecodeRequest(room=room, prefill_addr=prefill, token_ids=ids,
                                                               params=params), timeout=5)),
            "Decode.Abort": d.Abort(wpb.AbortRoomRequest(room=room, reason="intruder"), timeout=5),
            "Decode.Load": d.Load(wpb.LoadRequest(), timeout=5),
            "KVBootstrap.RegisterPeer": b.RegisterPeer(bpb.RegisterPeerRequest(protocol_version=PROTOCOL_VERSION,
                                                                              worker_id="intruder"), timeout=5),
            "KVBootstrap.Attach": b.Attach(bpb.AttachRequest(protocol_version=PROTOCOL_VERSION, room=room), timeout=5),
            "KVBootstrap.Abort": b.Abort(bpb.AbortRequest(protocol_version=PROTOCOL_VERSION, room=room), timeout=5),
            "KVBootstrap.Heartbeat": b.Heartbeat(bpb.HeartbeatRequest(protocol_version=PROTOCOL_VERSION), timeout=5),
        }
        for name, coro in calls.items():
            out["no_token"][name] = await code_of(coro)
        hc = health_pb2_grpc.HealthStub(pch)
        reply = await hc.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        out["health_without_token"] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # a live room: the Prefill RPC (with the token) creates it; an intruder's Attach is refused
    # while it waits; then the real decode (with the token) attaches and the room completes
    room = random.getrandbits(63)
    async with channel(prefill, token=token) as pch, channel(decode, token=token) as dch, \
            channel(prefill, token="") as ich:
        p, d, intruder = wpb_grpc.PrefillStub(pch), wpb_grpc.DecodeStub(dch), bpb_grpc.KVBootstrapStub(ich)
        prefill_call = asyncio.ensure_future(
            p.Prefill(wpb.PrefillRequest(room=room, token_ids=ids, params=params), timeout=20))
        load = wpb.LoadReply()
        for _ in range(200):  # the room exists once prefill reports it queued
            load = await p.Load(wpb.LoadRequest(), timeout=5)
            if load.queued:
                break
            await asyncio.sleep(0.02)
        out["room_live_at_prefill"] = bool(load.queued)
        out["intruder_attach"] = await code_of(intruder.Attach(
            bpb.AttachRequest(protocol_version=PROTOCOL_VERSION, room=room, agent_name="intruder", epoch=1,
                              dst_pages=[0], dst_aux_slot=0), timeout=5))
        tokens: list[int] = []
        try:
            async for chunk in d.Decode(wpb.DecodeRequest(room=room, prefill_addr=prefill, token_ids=ids,
                                                          params=params), timeout=20):
                tokens.extend(chunk.token_ids)
            out["real_decode"] = "OK"
        except grpc.aio.AioRpcError as e:
            out["real_decode"] = e.code().name
        out["real_decode_tokens"] = len(tokens)
        try:
            await prefill_call
            out["real_prefill"] = "OK"
        except grpc.aio.AioRpcError as e:
            out["real_prefill"] = e.code().name
    return out


async def _drain(call):
    async for _ in call:
        pass


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
