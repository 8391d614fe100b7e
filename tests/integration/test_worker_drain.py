"""A worker's graceful stop (SIGTERM) drains: it reports NOT_SERVING and refuses new calls at
once, but the stream it is running continues to its last token (nobody moves it here: no
router), /metrics and /health answer throughout, and it exits 0 once it holds nothing."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import httpx
import pytest

from services.common.refusal import Refusal, refusal_of
from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

STEP = 0.2  # seconds per decode forward (delay_forward): 80 tokens take ~16 s
TOKENS = 80


def test_a_stopping_decode_finishes_its_stream_and_refuses_new_ones(mesh):
    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--faults", f"delay_forward={STEP}", "--drain-timeout", "40", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault(
        "held", asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(10, 40)), params, timeout=60))))
    runner.start()
    wait_for(lambda: d.metrics()["pdmesh:num_running_reqs"] == 1, 30, "the stream to run on decode")
    t_term = time.monotonic()
    d.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(d.http_url + "/health", timeout=2).json()["status"] == "not_serving", 10,
             "decode to report NOT_SERVING", poll=0.05)
    # a new call while it drains: refused at once (the router would fail it over)
    late = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(50, 60)), params, timeout=20))
    assert late.decode_error is not None and late.decode_error.code() == grpc.StatusCode.UNAVAILABLE, late
    assert "stopping" in late.decode_error.details()
    assert refusal_of(late.decode_error) is Refusal.DRAINING
    assert d.metrics()["pdmesh:up"] == 0  # scrapes still answer, and say it no longer serves
    runner.join(60)
    held = box["held"]
    assert held.decode_error is None and held.prefill_error is None, held
    assert len(held.tokens) == TOKENS and held.finish_reason == "length"
    d.popen.wait(timeout=30)
    assert d.popen.returncode == 0, d.log()[-2000:]
    assert time.monotonic() - t_term > 2  # longer than the former fixed 2 s grace
    log = d.log()
    assert "decode worker drained" in log, log[-2000:]
    mesh.assert_invariants()
