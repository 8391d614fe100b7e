"""least_loaded follows the workers' own queue depths, not only the router's requests: load
that other clients put on a prefill steers the router's choice away from it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from tests.integration.mesh import in_background, wait_for

pytestmark = pytest.mark.integration


def test_least_loaded_avoids_a_prefill_busy_with_other_clients(mesh):
    busy = mesh.start_prefill("--faults", "delay_forward=3", wait=False)
    idle = mesh.start_prefill(wait=False)
    d = mesh.start_decode(wait=False)
    for proc in (busy, idle, d):
        mesh.wait_healthy(proc)
    router = mesh.start_router(
        [busy, idle], [d], "--policy", "least_loaded", "--health-check-interval", "0.2", "--request-timeout", "60"
    )

    # another client (not the router) queues slow requests on `busy`: one in a forward, then two
    # more that wait behind it (sent together, the three would share one forward and queue nothing)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def other_client():
        return in_background(lambda: asyncio.run(generate(busy.grpc_addr, d.grpc_addr, [5] * 20, params, timeout=60)))

    threads = [other_client()]
    wait_for(lambda: busy.metrics()["pdmesh:num_running_reqs"] >= 1, 20, "a forward on the busy prefill")
    threads += [other_client() for _ in range(2)]
    wait_for(lambda: busy.metrics()["pdmesh:num_queue_reqs"] >= 1, 20, "a queue on the busy prefill")
    # the router learns it from the Load RPC of its next probe
    wait_for(
        lambda: httpx.get(router.http_url + "/health", timeout=5).json()
        .get("prefill", {}).get(busy.grpc_addr, {}).get("external_load", 0) >= 2,
        5, "the router to see the busy prefill's queue",
    )
    before = busy.metrics()["pdmesh:num_requests_total"]
    with httpx.Client(base_url=router.http_url, timeout=60) as client:
        for i in range(4):
            r = client.post("/v1/completions", json={"model": "pdmesh-tiny", "prompt": f"hi {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
    # round_robin would have sent two of the four to the busy prefill
    assert busy.metrics()["pdmesh:num_requests_total"] == before
    assert idle.metrics()["pdmesh:num_requests_total"] == 4
    for t, box in threads:
        t.join(timeout=60)
        assert box["out"].ok
    mesh.assert_invariants()
