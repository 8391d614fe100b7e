"""A worker's graceful stop (SIGTERM) drains: it reports NOT_SERVING and refuses new calls at
once, but the stream it is running continues to its last token (with no router, nobody moves
it), /metrics and /health answer throughout, and it exits 0 once it holds nothing. Through a
router, a stream longer than the drain moves to another decode instead of being cut."""

from __future__ import annotations

import asyncio
import json
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

STEP = 0.2  # seconds per decode forward (delay_forward): 40 tokens take ~8 s, well past the 2 s below
TOKENS = 40


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


def test_a_stream_longer_than_the_drain_migrates_off_a_stopping_decode(mesh):
    """Through the router: a decode stopped mid-stream with a 1 s --drain-timeout cannot finish a
    ~6 s stream. The stream moves to the other decode — the router ejects the NOT_SERVING decode
    and migrates what it runs there, or the drain's end cuts it and the router migrates then —
    and the client sees one unbroken stream with the uninterrupted text."""
    drain = ("--faults", "delay_forward=0.15", "--drain-timeout", "1")
    p = mesh.start_prefill(wait=False)
    ds = [mesh.start_decode(*drain, wait=False) for _ in range(2)]
    for w in (p, *ds):
        mesh.wait_healthy(w)
    r = mesh.start_router([p], ds, "--health-check-interval", "0.5", "--local-prefill-max-tokens", "0")
    body = {"model": "pdmesh-tiny", "prompt": "A stream that outlives its decode's drain", "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    box: dict = {"text": "", "events": 0}

    def read() -> None:
        with httpx.stream("POST", r.http_url + "/v1/completions", json=body, timeout=90) as resp:
            box["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    box.setdefault("errors", []).extend([event["error"]] if "error" in event else [])
                    if event.get("choices"):
                        box["text"] += event["choices"][0]["text"]
                        box["events"] += 1
                        box["finish"] = event["choices"][0]["finish_reason"] or box.get("finish")

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: box["events"] >= 5, 60, "the stream to flow")
    busy = next(d for d in ds if d.metrics()["pdmesh:num_running_reqs"] == 1)
    busy.popen.send_signal(signal.SIGTERM)
    reader.join(90)
    assert not reader.is_alive()
    busy.popen.wait(timeout=30)
    assert busy.popen.returncode == 0, busy.log()[-2000:]
    assert box["status"] == 200 and not box.get("errors") and box["finish"] == "length", box
    assert '"decode done"' not in busy.log()  # the stopping decode did not finish the stream itself
    assert r.metrics()["pdmesh:router_migrations_total"] >= 1
    reference = r.post("/v1/completions", {**body, "stream": False}, timeout=90).json()["choices"][0]["text"]
    assert box["text"] == reference
    mesh.assert_invariants()
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "no admission slot held")
