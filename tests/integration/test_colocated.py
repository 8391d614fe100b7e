"""The colocated baseline (router --mode colocated): decode computes the prompt itself.

- Decode driven directly with `colocated` set: concurrent prompts of mixed lengths, several
  longer than decode's --chunked-prefill-size (so their prompt runs in chunks between decode
  steps of the others), greedy and seeded, equal token for token to single-process generation;
  malformed requests (colocated with a prefill_addr, neither) are refused.
- Through two routers on the same workers, one --mode pd and one --mode colocated: the same
  requests give the same text on both.
- Migration in colocated mode (two decodes): the decode streaming a request is SIGKILLed after
  20 chunks; the stream completes with exactly the uninterrupted text.

Every wait is bounded; every scenario ends with mesh.assert_invariants().
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.fakes.worker_client import new_room
from tests.integration.mesh import Mesh

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
CHUNK = 64
DECODE_FLAGS = ("--chunked-prefill-size", str(CHUNK), "--watchdog-interval", "0.5", "--prealloc-timeout", "10")
ROUTER_FLAGS = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5", "--request-timeout", "120",
                "--stream-stall-timeout", "2")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("colocated"))
    try:
        (p,), ds = m.start_workers(1, 2, ("--chunked-prefill-size", str(CHUNK)), DECODE_FLAGS)
        pd = m.start_router([p], [ds[0]], *ROUTER_FLAGS)
        colo = m.start_router([], ds, *ROUTER_FLAGS, "--mode", "colocated")
        yield m, p, ds, pd, colo
    finally:
        m.close()


async def colocated_decode(addr: str, ids: list[int], params: SamplingParams, prefill_addr: str = "",
                           colocated: bool = True) -> list[int]:
    async with channel(addr) as ch:
        stream = wpb_grpc.DecodeStub(ch).Decode(
            wpb.DecodeRequest(room=new_room(), prefill_addr=prefill_addr, token_ids=ids,
                              params=params_to_pb(params), colocated=colocated), timeout=60)
        out: list[int] = []
        async for chunk in stream:
            out.extend(chunk.token_ids)
        return out


def test_decode_computes_the_prompt_like_single_process(mesh):
    m, p, ds, _, _ = mesh
    rng = random.Random(11)
    lengths = [3, 17, 40, CHUNK, CHUNK + 1, 150, 300, 5, 9, 250]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 40), ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]

    async def all_of_them():
        return await asyncio.gather(*(colocated_decode(ds[0].grpc_addr, ids, sp) for ids, sp in zip(prompts, params, strict=True)))

    got = asyncio.run(all_of_them())
    model = load_model(None)
    want = generate_full(model.model, KVPool(model.config, num_pages=512, page_size=16), prompts, params)
    assert got == [g.token_ids for g in want]

    for kw in ({"prefill_addr": p.grpc_addr}, {"colocated": False}):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(colocated_decode(ds[0].grpc_addr, [1, 2, 3], params[0], **kw))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    m.assert_invariants()


def completion(url: str, prompt: str, **kw) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_router_colocated_equals_pd(mesh):
    m, _, _, pd, colo = mesh
    prompts = ["Hello", "Once upon a time, " * 30, "x" * 200]
    for prompt in prompts:
        for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
            assert completion(colo.http_url, prompt, **kw) == completion(pd.http_url, prompt, **kw)
    m.assert_invariants()


def stream(url: str, payload: dict, after: int = 0, fault=None) -> tuple[str, list[dict]]:
    events: list[dict] = []
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        with client.stream("POST", url + "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if fault is not None and len(events) == after:
                    fault()
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_colocated_migrates_when_its_decode_dies(mesh):
    m, _, ds, _, colo = mesh
    payload = {"model": MODEL, "prompt": "A long story: " * 20, "max_tokens": 600, "ignore_eos": True,
               "temperature": 0.8, "seed": 99, "stream": True}
    reference, _ = stream(colo.http_url, payload)

    def kill():
        status = httpx.get(colo.http_url + "/health", timeout=5).json()["decode"]
        busy = [d for d in ds if status[d.grpc_addr]["inflight"] > 0]
        assert len(busy) == 1, status
        busy[0].kill()

    text, events = stream(colo.http_url, payload, after=20, fault=kill)
    assert not any("error" in e for e in events)
    assert text == reference
    m.assert_invariants()
