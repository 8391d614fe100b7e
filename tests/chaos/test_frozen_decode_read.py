"""Decode freezes between offering its held prefix and prefill's READ of it. A frozen process
answers nothing, yet a one-sided READ over shared memory may still complete; either way prefill
lets go within its own bounds (--kv-read-timeout for the READ, then --inflight-timeout for the
WRITE of what it computed instead) and serves the next request with its pages whole."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from services.launch.probes import QUEUE_GAUGES
from tests.integration.mesh import in_background, wait_for

pytestmark = pytest.mark.integration

READ_TIMEOUT, INFLIGHT_TIMEOUT = 1.0, 4.0
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _reads(m: dict[str, float]) -> float:
    """READs of a held prefix that prefill started and ended, verified or given up."""
    return m.get("pdmesh:kv_read_pages_total", 0) + sum(v for k, v in m.items()
                                                         if k.startswith("pdmesh:kv_read_failures_total"))


def test_a_decode_frozen_before_the_read_never_holds_prefill(mesh):
    # delay_forward: round 2's prompt is cached but for one page, so its KV could otherwise land
    # before decode handles the Attach reply (and freezes) on a loaded machine
    p = mesh.start_prefill("--kv-read-timeout", str(READ_TIMEOUT), "--inflight-timeout", str(INFLIGHT_TIMEOUT),
                           "--watchdog-interval", "0.5", "--faults", "delay_forward=1", wait=False)
    d = mesh.start_decode("--faults", "sigstop_after_held_attach", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    # round 1: 50 prompt tokens (3 full pages on prefill) and a 20-token reply; decode then holds
    # 4 full pages of prompt + reply, the 4th of which prefill never computed
    first = list(range(30, 80))
    one = asyncio.run(generate(p.grpc_addr, d.grpc_addr, first, PARAMS, timeout=60))
    assert one.ok, (one.prefill_error, one.decode_error)
    assert _reads(p.metrics()) == 0
    # round 2: decode attaches offering its 4 held pages and freezes; prefill must READ the 4th
    second = first + one.tokens + list(range(100, 110))
    t, box = in_background(lambda: asyncio.run(generate(p.grpc_addr, d.grpc_addr, second, PARAMS, timeout=60,
                                                         cancel_on_failure=False)))
    wait_for(lambda: _reads(p.metrics()) >= 1, 30, "prefill's READ of the frozen decode's held page to end")
    started = time.monotonic()
    wait_for(lambda: all(p.metrics().get(q, 0) == 0 for q in QUEUE_GAUGES["prefill"]), READ_TIMEOUT + INFLIGHT_TIMEOUT + 10,
             "prefill to let go of the room")
    print(f"prefill let go {time.monotonic() - started:.2f}s after its READ ended; reads={_reads(p.metrics())}")
    d.kill()
    t.join(timeout=70)
    assert not t.is_alive()
    assert not box["out"].ok  # its decode froze and died: the request failed, it did not hang
    # prefill serves the next decode at once, from a whole pool
    d2 = mesh.start_decode()
    three = asyncio.run(generate(p.grpc_addr, d2.grpc_addr, list(range(200, 240)), PARAMS, timeout=60))
    assert three.ok, (three.prefill_error, three.decode_error)
    mesh.assert_invariants(nixl=True)
