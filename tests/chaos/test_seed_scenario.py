"""The seed scenario: decode freezes right after attaching; nothing else arrives.

SGLang on NIXL leaves such a request in prefill's inflight queue until new traffic shows up.
pdmesh's watchdog must evict it on an idle worker within inflight_timeout + interval (+1 s)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from tests.integration.mesh import in_background, wait_for

pytestmark = pytest.mark.integration

INFLIGHT_TIMEOUT, INTERVAL = 2.0, 0.5
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_frozen_decode_is_evicted_on_an_idle_prefill(mesh):
    p = mesh.start_prefill(
        "--inflight-timeout", str(INFLIGHT_TIMEOUT), "--watchdog-interval", str(INTERVAL),
        # the forward outlasts decode's handling of its Attach reply, so decode is frozen before
        # the WRITE (on a loaded machine the KV could otherwise land first)
        "--faults", "delay_forward=1", wait=False,
    )
    d = mesh.start_decode("--faults", "sigstop_after_attach", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)

    thread, box = in_background(
        lambda: asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(10, 60)), PARAMS, timeout=60))
    )
    wait_for(lambda: p.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 1, 30, "the room to reach inflight")
    seen_inflight = time.monotonic()
    # no further request is sent: only the watchdog's timer can end this
    wait_for(
        lambda: p.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 0,
        INFLIGHT_TIMEOUT + INTERVAL + 1.0,
        "the watchdog to evict the inflight room",
    )
    evicted_after = time.monotonic() - seen_inflight
    m = p.metrics()
    assert m["pdmesh:watchdog_evictions_total{queue=inflight}"] == 1
    h = p.health()
    assert h["kv_pages_free"] == h["kv_pages_total"] and h["nixl_live_handles"] == 0
    wait_for(lambda: "out" in box, 10, "the Prefill RPC to fail")
    out = box["out"]
    assert out.prefill_error is not None and out.prefill_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "inflight" in out.prefill_error.details() and "deadline" in out.prefill_error.details()
    print(f"evicted {evicted_after:.2f}s after the room was seen inflight")

    # SIGCONT: decode resumes, learns its room is gone, and serves the next request at once
    d.cont()
    thread.join(timeout=30)
    nxt = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(5, 40)), PARAMS, timeout=30))
    assert nxt.ok, (nxt.prefill_error, nxt.decode_error)
    mesh.assert_invariants()

    # a decode restart (new epoch, no fault) is served at once too, prefill untouched
    d2 = mesh.restart(d, drop_flags=("--faults",))
    again = asyncio.run(generate(p.grpc_addr, d2.grpc_addr, list(range(7, 30)), PARAMS, timeout=30))
    assert again.ok, (again.prefill_error, again.decode_error)
    assert p.alive()
    mesh.assert_invariants()
