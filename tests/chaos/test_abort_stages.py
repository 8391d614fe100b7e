"""Abort at every stage: exactly-once cleanup, pages whole and gauges 0 on both workers.

Bootstrap and running aborts are in tests/integration/test_workers_serving.py; this file covers
prefill waiting / mid-forward / inflight and decode prealloc / transfer, using fault injection
to hold a room in each stage."""

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
from tests.integration.mesh import Mesh, wait_for

pytestmark = pytest.mark.integration

PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("abort"))
    try:
        slow = m.start_prefill("--faults", "delay_forward=2", wait=False)
        stall = m.start_prefill("--faults", "stall_transfer", "--inflight-timeout", "60", wait=False)
        d = m.start_decode("--num-pages", "12", "--heartbeat-interval", "0.5", wait=False)
        for proc in (slow, stall, d):
            m.wait_healthy(proc)
        yield m, slow, stall, d
    finally:
        m.close()


class Request:
    """Prefill and Decode RPCs of one room, each cancellable on its own."""

    def __init__(self, pch, dch, prefill_addr: str, n_tokens: int):
        self.room = new_room()
        ids = [11] * n_tokens
        self.prefill = asyncio.ensure_future(
            wpb_grpc.PrefillStub(pch).Prefill(wpb.PrefillRequest(room=self.room, token_ids=ids, params=PARAMS))
        )
        self.decode = asyncio.ensure_future(self._drain(dch, prefill_addr, ids))

    async def _drain(self, dch, prefill_addr, ids):
        stream = wpb_grpc.DecodeStub(dch).Decode(
            wpb.DecodeRequest(room=self.room, prefill_addr=prefill_addr, token_ids=ids, params=PARAMS)
        )
        return [t async for chunk in stream for t in chunk.token_ids]

    async def outcome(self, timeout=20):
        done = await asyncio.wait_for(asyncio.gather(self.prefill, self.decode, return_exceptions=True), timeout)
        return done


async def until(cond, timeout=20, what="condition"):
    await asyncio.to_thread(wait_for, cond, timeout, what)


def _code(result):
    return result.code() if isinstance(result, grpc.aio.AioRpcError) else result


def test_abort_waiting_and_mid_forward_propagate_to_the_peer(stages):
    m, slow, _, d = stages

    async def scenario():
        async with channel(slow.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            first = Request(pch, dch, slow.grpc_addr, 20)
            await until(lambda: slow.metrics()["pdmesh:num_running_reqs"] == 1, what="first in forward")
            second = Request(pch, dch, slow.grpc_addr, 20)
            await until(lambda: slow.metrics()["pdmesh:num_queue_reqs"] == 1, what="second waiting")
            await until(lambda: d.metrics()["pdmesh:num_decode_transfer_queue_reqs"] == 2, what="decode waits for both")
            # waiting (prefill) / transfer (decode): the Decode RPC is cancelled; decode aborts the
            # room and tells prefill, whose Prefill RPC then fails
            second.decode.cancel()
            p_res, _ = await second.outcome()
            assert _code(p_res) == grpc.StatusCode.UNAVAILABLE and "aborted by decode" in p_res.details()
            assert slow.metrics()["pdmesh:num_queue_reqs"] == 0
            assert slow.metrics()["pdmesh:num_running_reqs"] == 1  # the first is still computing
            # mid-forward (prefill): the Prefill RPC is cancelled; prefill tells decode over NIXL's
            # notification channel, well before decode's next heartbeat would have noticed
            first.prefill.cancel()
            _, d_res = await first.outcome()
            assert _code(d_res) == grpc.StatusCode.UNAVAILABLE and "prefill gave up the room" in d_res.details()

    asyncio.run(scenario())
    m.assert_invariants()


def test_abort_in_decode_prealloc(stages):
    m, slow, _, d = stages

    async def scenario():
        async with channel(slow.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            big = Request(pch, dch, slow.grpc_addr, 150)  # 10 of decode's 12 pages
            await until(lambda: d.health()["kv_pages_free"] == 2, what="big request to hold pages")
            starved = Request(pch, dch, slow.grpc_addr, 100)  # needs 7 pages: waits in prealloc
            await until(lambda: d.metrics()["pdmesh:num_decode_prealloc_queue_reqs"] == 1, what="prealloc")
            starved.decode.cancel()
            starved.prefill.cancel()  # the client went away: both RPCs end
            await asyncio.gather(starved.prefill, starved.decode, return_exceptions=True)
            await until(lambda: d.metrics()["pdmesh:num_decode_prealloc_queue_reqs"] == 0, what="prealloc empty")
            p_res, d_res = await big.outcome()
            assert not isinstance(p_res, Exception) and len(d_res) == 4

    asyncio.run(scenario())
    m.assert_invariants()


def test_abort_in_inflight(stages):
    m, _, stall, d = stages

    async def scenario():
        async with channel(stall.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            req = Request(pch, dch, stall.grpc_addr, 30)
            await until(lambda: stall.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 1, what="inflight")
            t0 = time.monotonic()
            req.prefill.cancel()
            req.decode.cancel()
            await asyncio.gather(req.prefill, req.decode, return_exceptions=True)
            await until(lambda: stall.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 0, what="inflight empty")
            assert time.monotonic() - t0 < 5  # by the abort, not the 60 s deadline

    asyncio.run(scenario())
    m.assert_invariants()
    assert stall.health()["nixl_live_handles"] == 0
