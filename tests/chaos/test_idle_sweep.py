"""Item 6, work that must move without traffic: on an idle prefill, an Attach whose Prefill RPC
never comes is dropped by the watchdog sweep after its deadline + one interval (the progress
poller sleeps: nothing is in flight), and decode's room then ends through the heartbeat, its
pages released through the quarantine once prefill answers quiesced."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.fakes.worker_client import new_room
from tests.integration.mesh import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TTL, WD = 1.0, 0.25


def test_idle_prefill_drops_a_parked_attach_after_its_deadline(mesh):
    p = mesh.start_prefill("--bootstrap-timeout", str(TTL), "--watchdog-interval", str(WD), wait=False)
    d = mesh.start_decode("--heartbeat-interval", "0.5", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)

    async def scenario():
        room, ids = new_room(), list(range(1, 30))
        async with channel(d.grpc_addr) as dch:
            stream = wpb_grpc.DecodeStub(dch).Decode(
                wpb.DecodeRequest(room=room, prefill_addr=p.grpc_addr, token_ids=ids, params=params_to_pb(PARAMS)),
                timeout=30,
            )

            async def drain():
                try:
                    return [c async for c in stream]
                except grpc.aio.AioRpcError as e:
                    return e

            dec = asyncio.ensure_future(drain())
            # no Prefill RPC: decode's Attach is parked on prefill
            await asyncio.to_thread(wait_for, lambda: p.health()["pending_attaches"] == 1, 20, "attach parked")
            parked_at = time.monotonic()
            await asyncio.to_thread(wait_for, lambda: p.health()["pending_attaches"] == 0, 10, "parked attach dropped")
            assert time.monotonic() - parked_at < TTL + WD + 0.75
            err = await asyncio.wait_for(dec, 15)
            assert isinstance(err, grpc.aio.AioRpcError), err  # prefill no longer holds the room

    asyncio.run(scenario())
    mesh.assert_invariants()
    for w in (p, d):
        h = w.health()
        assert h["nixl_live_handles"] == 0 and h.get("nixl_deferred_handles", 0) == 0, h
        assert h.get("kv_pages_quarantined", 0) == 0, h
