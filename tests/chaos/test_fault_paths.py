"""The remaining fault paths: a lost notification (decode's transfer deadline), a refused
attach, and the late-write quarantine on decode while prefill is frozen."""

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
from services.fakes.worker_client import generate, new_room
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)



def test_lost_notification_hits_decodes_transfer_deadline(mesh):
    transfer_timeout, hb, wd = 1.0, 0.5, 0.25
    p = mesh.start_prefill("--faults", "drop_notification", wait=False)
    d = mesh.start_decode(
        "--transfer-timeout", str(transfer_timeout), "--heartbeat-interval", str(hb),
        "--watchdog-interval", str(wd), wait=False,
    )
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    t0 = time.monotonic()
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(30)), PARAMS, timeout=30, cancel_on_failure=False))
    elapsed = time.monotonic() - t0
    # prefill's WRITE completed (the bytes landed), but decode never heard of it
    assert out.prefill_error is None and out.prefill_reply is not None
    assert out.decode_error is not None and out.decode_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "transfer" in out.decode_error.details()
    # phase 2 starts at the first heartbeat after the forward; then deadline + one sweep
    assert elapsed < hb + transfer_timeout + wd + 1.0
    assert d.metrics()["pdmesh:watchdog_evictions_total{queue=transfer}"] == 1
    mesh.assert_invariants()


def test_refused_attach_fails_the_request_cleanly(mesh):
    p = mesh.start_prefill("--faults", "fail_attach", "--bootstrap-timeout", "30", wait=False)
    d = mesh.start_decode(wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    # both RPCs run to their own end: which of the two errors reaches the client first is a race
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(30)), PARAMS, timeout=30,
                               cancel_on_failure=False))
    assert out.decode_error is not None and out.decode_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "fail_attach" in out.decode_error.details()
    # decode told prefill it released the room, so prefill's bootstrap room is gone too
    assert out.prefill_error is not None and "aborted by decode" in out.prefill_error.details()
    mesh.assert_invariants()
    assert d.metrics()["pdmesh:num_bootstrap_failed_reqs_total"] == 1


def test_decode_quarantines_pages_until_a_frozen_prefill_lets_go(mesh):
    p = mesh.start_prefill("--faults", "delay_forward=3", wait=False)
    d = mesh.start_decode("--heartbeat-interval", "0.5", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)

    async def scenario():
        room, ids = new_room(), [3] * 40
        async with channel(p.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            prefill = asyncio.ensure_future(
                wpb_grpc.PrefillStub(pch).Prefill(wpb.PrefillRequest(room=room, token_ids=ids, params=params_to_pb(PARAMS)))
            )

            async def drain():
                stream = wpb_grpc.DecodeStub(dch).Decode(
                    wpb.DecodeRequest(room=room, prefill_addr=p.grpc_addr, token_ids=ids, params=params_to_pb(PARAMS))
                )
                return [c async for c in stream]

            decode = asyncio.ensure_future(drain())
            await asyncio.to_thread(
                wait_for, lambda: p.metrics()["pdmesh:num_running_reqs"] == 1
                and d.metrics()["pdmesh:num_decode_transfer_queue_reqs"] == 1, 20, "forward running, decode waiting",
            )
            p.stop()  # prefill frozen mid-forward: it still knows decode's page ids
            decode.cancel()  # the client leaves: decode fails the room
            await asyncio.gather(decode, return_exceptions=True)
            h = await asyncio.to_thread(wait_for, lambda: (x := d.health())["kv_pages_quarantined"] > 0 and x, 10, "q")
            assert h["kv_pages_free"] < h["kv_pages_total"]  # not handed to anyone else yet
            assert d.metrics()["pdmesh:num_decode_transfer_queue_reqs"] == 0
            p.cont()  # prefill answers the abort: only now are the pages released
            await asyncio.to_thread(
                wait_for, lambda: d.health()["kv_pages_quarantined"] == 0, 15, "quarantine released"
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await prefill
            assert "aborted by decode" in e.value.details()

    asyncio.run(scenario())
    mesh.assert_invariants()
