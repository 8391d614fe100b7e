"""Decode's KV pool runs dry mid-generation: later requests are retracted and recompute their
KV when pages free up; every request still yields exactly the single-process tokens."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from services.common.refusal import Refusal, refusal_of
from services.common.sampling_params import SamplingParams
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.fakes.worker_client import generate
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

PAGE = 16
PAGES = 12  # 192 token slots: 6 prompts of 20 fit, their 40-token continuations do not


@pytest.fixture(scope="module")
def reference_model():
    return load_model(None)


def test_pool_exhaustion_retracts_and_resumes_with_identical_tokens(mesh, reference_model):
    p = mesh.start_prefill(wait=False)
    # each decode step sleeps 50 ms (no CPU), so the six requests overlap however slowly a loaded
    # machine prefills them: retraction needs them running together, not one after another
    d = mesh.start_decode("--num-pages", str(PAGES), "--page-size", str(PAGE), "--faults", "delay_forward=0.05",
                          wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(20)] for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in range(5)]
    params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True))
    assert sum(-(-(20 + 40) // PAGE) for _ in prompts) > PAGES  # the pool cannot hold them all

    async def all_requests():
        return await asyncio.gather(*(generate(p.grpc_addr, d.grpc_addr, pr, pa, timeout=60)
                                      for pr, pa in zip(prompts, params, strict=True)))

    outs = asyncio.run(all_requests())
    refs = generate_full(reference_model.model, KVPool(reference_model.config, 64, PAGE), prompts, params)
    for out, ref in zip(outs, refs, strict=True):
        assert out.ok, (out.prefill_error, out.decode_error)
        assert out.tokens == ref.token_ids
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert d.metrics()["pdmesh:num_retracted_requests_total"] >= 1
    mesh.assert_invariants()


def test_a_context_that_outgrows_the_whole_pool_fails_clearly(mesh):
    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--num-pages", "4", "--page-size", str(PAGE), wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(30, 60)), params, timeout=30))
    assert out.decode_error is not None and out.decode_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "outgrew the KV pool" in out.decode_error.details()
    assert 0 < len(out.tokens) < 60  # it streamed what fit, then ended with the error

    # a prompt that can never fit is refused at once, not left to wait for pages
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(100)), params, timeout=30))
    assert out.decode_error is not None and out.decode_error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "KV pages" in out.decode_error.details()
    assert refusal_of(out.decode_error) is Refusal.KV_CAPACITY  # what the router acts on: the code
    mesh.assert_invariants()
    assert d.metrics()["pdmesh:num_retracted_requests_total"] == 0

@pytest.mark.long

def test_clients_leaving_while_retracted_leave_nothing_behind(mesh):
    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--num-pages", str(PAGES), "--page-size", str(PAGE), wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    # each continuation needs 9 of the 12 pages: the later requests wait retracted for long
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    prompts = [[7 + i] * 20 for i in range(5)]

    async def scenario():
        tasks = [asyncio.ensure_future(generate(p.grpc_addr, d.grpc_addr, pr, params, timeout=60)) for pr in prompts]
        await asyncio.to_thread(
            wait_for, lambda: d.metrics()["pdmesh:num_retracted_reqs"] >= 2, 30, "requests to be retracted"
        )
        for t in tasks:
            t.cancel()  # the clients leave: both RPCs of each request are cancelled
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    mesh.assert_invariants()  # retracted, resuming and running rooms all gave their pages back
    assert d.metrics()["pdmesh:num_retracted_requests_total"] >= 2


def test_through_the_router_retraction_is_invisible_to_clients(mesh):
    """Six concurrent streamed completions through the router on a decode whose pool holds only
    half of their KV: every one gets its full, uninterrupted stream; the greedy texts equal
    those of the same requests sent one at a time."""
    import httpx

    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--num-pages", str(PAGES), "--page-size", str(PAGE), wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    r = mesh.start_router([p], [d], "--request-timeout", "60")
    prompts = [f"request number {i}, tell me" for i in range(6)]  # about 25 tokens each

    async def complete(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": "pdmesh-tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = []
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    text.append(event["choices"][0]["text"])
        return "".join(text)

    async def scenario(together: bool) -> list[str]:
        async with httpx.AsyncClient(base_url=r.http_url, timeout=60) as client:
            if together:
                return await asyncio.gather(*(complete(client, pr) for pr in prompts))
            return [await complete(client, pr) for pr in prompts]

    concurrent = asyncio.run(scenario(True))
    assert d.metrics()["pdmesh:num_retracted_requests_total"] >= 1
    retractions = d.metrics()["pdmesh:num_retracted_requests_total"]
    alone = asyncio.run(scenario(False))
    assert d.metrics()["pdmesh:num_retracted_requests_total"] == retractions  # one at a time fits
    assert concurrent == alone
    mesh.assert_invariants()
