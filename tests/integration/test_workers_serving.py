"""Prefill + decode serving real requests: correctness against single-process generation,
aborts at every stage, and the event loop staying responsive during a long forward."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.fakes.worker_client import generate, new_room
from tests.integration.mesh import Mesh, wait_for

pytestmark = pytest.mark.integration

CHUNK = 64


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("plain"))
    try:
        (p,), (d,) = m.start_workers(1, 1, ("--chunked-prefill-size", str(CHUNK)), ())
        yield m, p, d
    finally:
        m.close()


@pytest.fixture(scope="module")
def reference_model():
    return load_model(None)


def _reference(model, prompts, params):
    pool = KVPool(model.config, num_pages=512, page_size=16)
    return generate_full(model.model, pool, prompts, params)


def test_concurrent_mixed_lengths_match_single_process(plain, reference_model):
    m, p, d = plain
    rng = random.Random(7)
    lengths = [rng.randint(3, 60) for _ in range(14)] + [CHUNK + 1, 2 * CHUNK, 150, 200, 257, 300]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 24), ignore_eos=True) if i % 4 else
        SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(len(prompts))
    ]
    assert len(prompts) == 20 and sum(n > CHUNK for n in lengths) >= 5

    async def all_requests():
        return await asyncio.gather(*(generate(p.grpc_addr, d.grpc_addr, pr, pa) for pr, pa in zip(prompts, params, strict=False)))

    outs = asyncio.run(all_requests())
    refs = _reference(reference_model, prompts, params)
    for out, ref, pa in zip(outs, refs, params, strict=True):
        assert out.ok, (out.prefill_error, out.decode_error)
        assert out.tokens == ref.token_ids
        assert out.finish_reason == "length" and len(out.tokens) == pa.max_tokens
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert out.prefill_reply.first_token == out.tokens[0]
    m.assert_invariants()
    mp, md = p.metrics(), d.metrics()
    assert mp["pdmesh:num_requests_total"] >= 20 and md["pdmesh:generation_tokens_total"] >= sum(
        pa.max_tokens for pa in params
    )


def test_eos_stops_generation(plain, reference_model):
    m, p, d = plain
    prompt = list(range(40, 90))
    free = _reference(reference_model, [prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    stop_token = free.token_ids[3]
    out = asyncio.run(
        generate(p.grpc_addr, d.grpc_addr, prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop_token,)))
    )
    assert out.ok and out.finish_reason == "stop"
    assert out.tokens == free.token_ids[: free.token_ids.index(stop_token) + 1]
    m.assert_invariants()


@contextlib.asynccontextmanager
async def _worker_stubs(p, d):
    """Prefill's and decode's stubs, each over its own channel."""
    async with channel(p.grpc_addr) as pch, channel(d.grpc_addr) as dch:
        yield wpb_grpc.PrefillStub(pch), wpb_grpc.DecodeStub(dch)


def test_bad_requests_get_invalid_argument(plain):
    m, p, d = plain

    async def calls():
        async with _worker_stubs(p, d) as (pst, dst):
            good = params_to_pb(SamplingParams(temperature=0, max_tokens=4))
            cases = [
                pst.Prefill(wpb.PrefillRequest(room=new_room(), token_ids=[], params=good), timeout=5),
                pst.Prefill(wpb.PrefillRequest(room=new_room(), token_ids=[1, 99999], params=good), timeout=5),
                pst.Prefill(wpb.PrefillRequest(room=new_room(), token_ids=[1] * 9000, params=good), timeout=5),
                pst.Prefill(
                    wpb.PrefillRequest(room=new_room(), token_ids=[1], params=wpb.SamplingParams(temperature=-1)),
                    timeout=5,
                ),
            ]
            codes = []
            for call in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                codes.append(e.value.code())
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in dst.Decode(wpb.DecodeRequest(room=new_room(), token_ids=[1, 2], params=good), timeout=5):
                    pass
            codes.append(e.value.code())
            return codes

    assert asyncio.run(calls()) == [grpc.StatusCode.INVALID_ARGUMENT] * 5
    m.assert_invariants()


async def _cancel_when(call, cond, timeout=20):
    """Start an RPC, wait until cond() holds, then cancel the RPC (what a client disconnect does)."""
    task = asyncio.ensure_future(call)
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        assert not task.done(), f"RPC ended early: {task.result() if not task.exception() else task.exception()}"
        await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_abort_in_bootstrap_and_while_running(plain):
    m, p, d = plain

    async def scenario():
        async with _worker_stubs(p, d) as (pst, dst):
            # bootstrap: prefill holds the room, no decode ever attaches; the caller goes away
            params = params_to_pb(SamplingParams(temperature=0, max_tokens=4))
            await _cancel_when(
                pst.Prefill(wpb.PrefillRequest(room=new_room(), token_ids=[5] * 30, params=params)),
                lambda: p.metrics()["pdmesh:num_prefill_prealloc_queue_reqs"] == 1,
            )
            # ... or the Abort RPC ends it
            room = new_room()
            call = asyncio.ensure_future(pst.Prefill(wpb.PrefillRequest(room=room, token_ids=[5] * 30, params=params)))
            await asyncio.to_thread(
                wait_for, lambda: p.metrics()["pdmesh:num_prefill_prealloc_queue_reqs"] == 1, 10, "bootstrap"
            )
            assert (await pst.Abort(wpb.AbortRoomRequest(room=room, reason="test"))).found
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            assert "aborted" in e.value.details()
            # running: a long generation cancelled mid-stream
            long = params_to_pb(SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
            room, got = new_room(), []
            prefill = asyncio.ensure_future(pst.Prefill(wpb.PrefillRequest(room=room, token_ids=[7] * 20, params=long)))
            stream = dst.Decode(wpb.DecodeRequest(room=room, prefill_addr=p.grpc_addr, token_ids=[7] * 20, params=long))
            async for chunk in stream:
                got.extend(chunk.token_ids)
                if len(got) >= 5:
                    break
            assert d.metrics()["pdmesh:num_running_reqs"] == 1
            stream.cancel()
            await prefill

    asyncio.run(scenario())
    m.assert_invariants()


def test_grpc_health_serving(plain):
    m, p, d = plain

    async def check(addr, service):
        async with channel(addr) as ch:
            return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

    assert asyncio.run(check(p.grpc_addr, "pdmesh.v1.Prefill")) == health_pb2.HealthCheckResponse.SERVING
    assert asyncio.run(check(d.grpc_addr, "pdmesh.v1.Decode")) == health_pb2.HealthCheckResponse.SERVING
    assert httpx.get(p.http_url + "/nope").status_code == 404
