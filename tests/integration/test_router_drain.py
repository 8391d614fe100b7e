"""A router's graceful stop (SIGTERM) with a stream in flight: it stops accepting, answers what
reaches it with 503 "shutting down" / health "draining", and lets the stream run to its end —
far past uvicorn's old 5 s — within --shutdown-timeout, then exits; the workers end whole."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

MODEL = "pdmesh-tiny"
STEP = 0.25  # seconds each decode forward takes (delay_forward): a stream of 40 tokens lasts ~10 s


def test_router_stop_lets_a_long_stream_finish(mesh):
    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--faults", f"delay_forward={STEP}", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    r = mesh.start_router([p], [d], "--shutdown-timeout", "40")
    events: list[str] = []
    first_token = threading.Event()
    result: dict = {}

    def stream():
        body = {"model": MODEL, "prompt": "A long answer", "max_tokens": 40, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", r.http_url + "/v1/completions", json=body, timeout=60) as resp:
                result["status"] = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_token.set()
        except httpx.HTTPError as e:
            result["error"] = repr(e)

    with httpx.Client(base_url=r.http_url, timeout=10) as keep_alive:
        assert keep_alive.get("/health").json()["status"] == "ok"
        client = threading.Thread(target=stream)
        client.start()
        assert first_token.wait(60), "no first token"
        t_term = time.monotonic()
        r.popen.send_signal(signal.SIGTERM)
        # new connections are refused, or (one that got in) answered 503 while it drains
        def refused_or_draining():
            try:
                resp = httpx.get(r.http_url + "/health", timeout=2)
            except httpx.HTTPError:
                return True
            return resp.status_code == 503 and resp.json()["status"] == "draining"

        wait_for(refused_or_draining, 10, "the router to stop taking new work", poll=0.05)
        client.join(60)
    assert not client.is_alive()
    ended = time.monotonic()
    assert "error" not in result and result["status"] == 200, result
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-2:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ended - t_term > 5, "the stream did not outlive the old 5 s shutdown grace"
    r.popen.wait(timeout=30)
    # uvicorn re-raises the signal it handled once it is done: the exit reads "killed by SIGTERM"
    assert r.popen.returncode in (0, -signal.SIGTERM), r.log()[-2000:]
    log = r.log()
    assert "router draining" in log
    mesh.assert_invariants()
