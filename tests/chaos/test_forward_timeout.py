"""Item 4b, liveness is not progress: a prefill forward stuck past --forward-timeout turns the
worker NOT_SERVING and decode's phase-1 wait ends within timeout + one heartbeat, although
prefill answers every heartbeat. When the forward returns, prefill serves again, its pages are
back, and a new request goes through."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.fakes.worker_client import generate, new_room
from tests.integration.mesh import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TIMEOUT, HB, WD, HANG = 1.5, 0.5, 0.25, 5.0


def test_stuck_prefill_forward_fails_decode_rooms_and_recovers(mesh):
    p = mesh.start_prefill(
        "--faults", f"hang_forward={HANG}", "--forward-timeout", str(TIMEOUT), "--watchdog-interval", str(WD),
        wait=False,
    )
    d = mesh.start_decode(
        "--forward-timeout", str(TIMEOUT), "--heartbeat-interval", str(HB), "--watchdog-interval", str(WD), wait=False
    )
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    statuses: list[tuple[float, int, dict]] = []  # prefill's /health over time

    async def scenario():
        room, ids = new_room(), list(range(1, 40))
        async with channel(p.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            t0 = time.monotonic()
            prefill = asyncio.ensure_future(
                wpb_grpc.PrefillStub(pch).Prefill(
                    wpb.PrefillRequest(room=room, token_ids=ids, params=params_to_pb(PARAMS)), timeout=60
                )
            )

            async def decode():
                stream = wpb_grpc.DecodeStub(dch).Decode(
                    wpb.DecodeRequest(room=room, prefill_addr=p.grpc_addr, token_ids=ids, params=params_to_pb(PARAMS)),
                    timeout=60,
                )
                try:
                    return [c async for c in stream]
                except grpc.aio.AioRpcError as e:
                    return e, time.monotonic() - t0

            dec = asyncio.ensure_future(decode())
            async with httpx.AsyncClient() as http:
                # poll prefill's /health until the RPCs ended and NOT_SERVING was seen (or the
                # hang is over: then the assertions below say what was missing)
                while not (prefill.done() and dec.done() and any(c == 503 for _, c, _ in statuses)):
                    if time.monotonic() - t0 > HANG + 5:
                        break
                    r = await http.get(p.http_url + "/health", timeout=2)
                    statuses.append((time.monotonic() - t0, r.status_code, r.json()))
                    await asyncio.sleep(0.05)
            err, failed_at = dec.result()
            assert isinstance(err, grpc.aio.AioRpcError), err
            assert "forward" in err.details() and "forward-timeout" in err.details(), err.details()
            # decode's wait is bounded by progress: timeout + one heartbeat (+ RPC slack), well
            # before the forward itself returns
            assert failed_at < TIMEOUT + HB + 1.5 < HANG, failed_at
            with pytest.raises(grpc.aio.AioRpcError):
                await prefill

    asyncio.run(scenario())
    down = [(t, h) for t, code, h in statuses if code == 503]
    assert down and "forward-timeout" in down[0][1]["problems"]["forward"], statuses[-3:]
    assert TIMEOUT <= down[0][0] < HANG
    # the hung forward returned: serving again, pages back, nothing in NIXL, gauges 0
    wait_for(lambda: httpx.get(p.http_url + "/health", timeout=2).status_code == 200, 15, "prefill serving again")
    mesh.assert_invariants()
    for w in (p, d):
        h = w.health()
        assert h["nixl_live_handles"] == 0 and h.get("kv_pages_quarantined", 0) == 0, h
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(1, 40)), PARAMS, timeout=30))
    assert out.ok, (out.prefill_error, out.decode_error)
    mesh.assert_invariants()
