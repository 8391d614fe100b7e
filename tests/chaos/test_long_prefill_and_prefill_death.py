"""No false failure on long prefills; a dead prefill fails decode's rooms by liveness; the loop
stays responsive during a long forward."""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate as local_generate
from services.fakes.worker_client import generate
from tests.integration.mesh import in_background, wait_for

pytestmark = pytest.mark.integration

FORWARD_DELAY = 4.0
SHORT = 1.0  # inflight and transfer timeouts, both well below the forward time
HB_INTERVAL, HB_FAILURES, WD_INTERVAL = 0.5, 3, 0.25
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)



def _grpc_health_latency(addr: str) -> float:
    async def one():
        async with channel(addr) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connect first
            t = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return time.perf_counter() - t

    return asyncio.run(one())


def test_long_prefill_succeeds_and_dead_prefill_fails_by_heartbeat(mesh):
    slow = mesh.start_prefill(
        "--faults", f"delay_forward={FORWARD_DELAY}", "--inflight-timeout", str(SHORT),
        "--watchdog-interval", str(WD_INTERVAL), wait=False,
    )
    healthy = mesh.start_prefill(wait=False)
    d = mesh.start_decode(
        "--transfer-timeout", str(SHORT), "--heartbeat-interval", str(HB_INTERVAL),
        "--heartbeat-max-failures", str(HB_FAILURES), "--watchdog-interval", str(WD_INTERVAL), wait=False,
    )
    for proc in (slow, healthy, d):
        mesh.wait_healthy(proc)
    prompt = list(range(30, 130))

    # 1. a forward longer than both timeouts succeeds, with the single-process tokens
    t, box = in_background(lambda: asyncio.run(generate(slow.grpc_addr, d.grpc_addr, prompt, PARAMS, timeout=60)))
    wait_for(lambda: slow.metrics()["pdmesh:num_running_reqs"] == 1, 20, "the slow forward to start")
    # 2. meanwhile the loop answers /metrics and gRPC health promptly
    metrics_lat, health_lat = [], []
    with httpx.Client(timeout=5) as client:  # keep-alive: measure the server, not TCP setup
        client.get(slow.http_url + "/metrics")
        while slow.metrics()["pdmesh:num_running_reqs"] == 1 and len(metrics_lat) < 10:
            t0 = time.perf_counter()
            client.get(slow.http_url + "/metrics")
            metrics_lat.append(time.perf_counter() - t0)
            health_lat.append(_grpc_health_latency(slow.grpc_addr))
    assert len(metrics_lat) >= 3
    assert max(metrics_lat) < 0.2 and max(health_lat) < 0.2, (metrics_lat, health_lat)
    t.join(timeout=30)
    out = box["out"]
    assert out.ok, (out.prefill_error, out.decode_error)
    model = load_model(None)
    ref = local_generate(model.model, KVPool(model.config, 64, 16), [prompt], [PARAMS])[0]
    assert out.tokens == ref
    print(f"/metrics during forward: median {statistics.median(metrics_lat)*1e3:.1f} ms, "
          f"max {max(metrics_lat)*1e3:.1f} ms; gRPC health max {max(health_lat)*1e3:.1f} ms")
    mesh.assert_invariants()

    # 3. the slow prefill dies mid-forward: decode fails the room by heartbeat, not by a clock
    #    (the client does not cancel Decode when Prefill fails: decode must end it by itself)
    t, box = in_background(
        lambda: asyncio.run(
            generate(slow.grpc_addr, d.grpc_addr, prompt, PARAMS, timeout=60, cancel_on_failure=False)
        )
    )
    wait_for(lambda: slow.metrics()["pdmesh:num_running_reqs"] == 1, 20, "the second slow forward to start")
    wait_for(lambda: d.metrics()["pdmesh:num_decode_transfer_queue_reqs"] == 1, 10, "decode to wait for KV")
    slow.kill()
    killed_at = time.monotonic()
    bound = HB_INTERVAL * HB_FAILURES + WD_INTERVAL + 1.0
    wait_for(lambda: d.metrics()["pdmesh:num_decode_transfer_queue_reqs"] == 0, bound, "decode to fail the room")
    print(f"decode failed the room {time.monotonic() - killed_at:.2f}s after prefill died (bound {bound}s)")
    t.join(timeout=30)
    out = box["out"]
    assert out.decode_error is not None and out.decode_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "prefill" in out.decode_error.details()

    # 4. decode keeps serving through the other prefill
    again = asyncio.run(generate(healthy.grpc_addr, d.grpc_addr, prompt, PARAMS, timeout=30))
    assert again.ok and again.tokens == ref
    mesh.assert_invariants()
