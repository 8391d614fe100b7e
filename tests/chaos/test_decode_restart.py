"""Decode dies with rooms in prefill's bootstrap and inflight queues, then comes back."""

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
from tests.integration.mesh import in_background, wait_for

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BOOTSTRAP_TIMEOUT, INFLIGHT_TIMEOUT = 3.0, 30.0



async def _prefill_only(addr: str, room: int):
    async with channel(addr) as ch:
        try:
            await wpb_grpc.PrefillStub(ch).Prefill(
                wpb.PrefillRequest(room=room, token_ids=[9] * 40, params=params_to_pb(PARAMS)), timeout=30
            )
        except grpc.aio.AioRpcError as e:
            return e
    return None


def test_decode_killed_then_restarted(mesh):
    p = mesh.start_prefill(
        "--bootstrap-timeout", str(BOOTSTRAP_TIMEOUT), "--inflight-timeout", str(INFLIGHT_TIMEOUT),
        "--watchdog-interval", "0.5",
        # the forward outlasts decode's freeze right after its attach: the WRITE then meets a frozen
        # decode (without it, a loaded machine may deliver the KV before the freeze lands)
        "--faults", "delay_forward=1", wait=False,
    )
    d = mesh.start_decode("--faults", "sigstop_after_attach", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)

    # a room in bootstrap: its decode never attaches (it is about to die)
    tb, bootstrap_box = in_background(lambda: asyncio.run(_prefill_only(p.grpc_addr, new_room())))
    # a room in inflight: decode attached, froze, prefill's WRITE sits in progress
    ti, inflight_box = in_background(
        lambda: asyncio.run(
            generate(p.grpc_addr, d.grpc_addr, list(range(20, 70)), PARAMS, timeout=60, cancel_on_failure=False)
        )
    )
    wait_for(
        lambda: (m := p.metrics())["pdmesh:num_prefill_inflight_queue_reqs"] == 1
        and m["pdmesh:num_prefill_prealloc_queue_reqs"] == 1,
        30,
        "one room in bootstrap and one in inflight",
    )
    d.kill()
    killed_at = time.monotonic()
    # inflight fails by NIXL's disconnect error, long before its 30 s deadline
    wait_for(lambda: p.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 0, 10, "inflight room to fail")
    inflight_failed_after = time.monotonic() - killed_at
    assert inflight_failed_after < INFLIGHT_TIMEOUT / 2
    ti.join(timeout=30)
    # the request fails (its decode is gone); prefill's side ends either with NIXL's disconnect
    # error or, when UCX had already moved the bytes one-sidedly into the frozen process, with
    # the WRITE done — what matters is that the inflight room ended at once, not by its deadline
    assert inflight_box["out"].decode_error is not None
    # bootstrap fails by its deadline
    wait_for(lambda: p.metrics()["pdmesh:num_prefill_prealloc_queue_reqs"] == 0, BOOTSTRAP_TIMEOUT + 2, "bootstrap")
    tb.join(timeout=30)
    err = bootstrap_box["out"]
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    m = p.metrics()
    assert m["pdmesh:watchdog_evictions_total{queue=bootstrap}"] == 1
    assert m.get("pdmesh:watchdog_evictions_total{queue=inflight}", 0) == 0
    print(f"inflight room failed {inflight_failed_after:.2f}s after decode was killed")

    # the restarted decode (new epoch) is served at once, prefill untouched
    d2 = mesh.restart(d, drop_flags=("--faults",))
    out = asyncio.run(generate(p.grpc_addr, d2.grpc_addr, list(range(20, 70)), PARAMS, timeout=30))
    assert out.ok, (out.prefill_error, out.decode_error)
    mesh.assert_invariants()
    assert p.health()["nixl_live_handles"] == 0
