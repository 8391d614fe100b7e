"""The ways a request could still get stuck or leak inside a worker (one lifecycle per
job), each reproduced through real processes, real gRPC and real NIXL:

- prefill's scheduler must not stop at an old job that cannot get pages while a later job that
  already holds its pages only needs compute (page-order deadlock);
- a forward that fails after its room was aborted mid-forward must still free the job's pages,
  on prefill and on decode;
- decode admits new requests as soon as the retracted ones have resumed, not when some
  unrelated page is freed later.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import channel
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.fakes.worker_client import generate, new_room
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def assert_no_live_handles(*procs) -> None:
    for proc in procs:
        wait_for(lambda p=proc: p.health()["nixl_live_handles"] == 0, 10, f"{proc.role}: no live NIXL handle")


def test_a_job_holding_pages_runs_while_an_older_one_waits_for_pages(mesh):
    # 40 pages of 16: B (600 tokens, 38 pages) takes nearly all; A (100 tokens, 7 pages) is older
    # but attaches only after B started, when its pages are not free.
    p = mesh.start_prefill("--num-pages", "40", "--page-size", "16", "--chunked-prefill-size", "64",
                           "--faults", "delay_forward=0.3", wait=False)
    d = mesh.start_decode(wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    a_ids, b_ids = [7] * 100, [9] * 600
    room_a = new_room()
    done: dict[str, float] = {}

    async def scenario():
        t0 = time.monotonic()
        async with channel(p.grpc_addr) as pch, channel(d.grpc_addr) as dch:
            prefill_a = asyncio.ensure_future(wpb_grpc.PrefillStub(pch).Prefill(
                wpb.PrefillRequest(room=room_a, token_ids=a_ids, params=params_to_pb(GREEDY)), timeout=30))
            await asyncio.to_thread(wait_for, lambda: p.metrics()["pdmesh:num_prefill_prealloc_queue_reqs"] == 1,
                                    10, "A in prefill's bootstrap queue")

            async def run_b():
                out = await generate(p.grpc_addr, d.grpc_addr, b_ids, GREEDY, timeout=30)
                done["B"] = time.monotonic() - t0
                return out

            async def decode_a():
                await asyncio.sleep(1.5)  # the scenario itself: A's Decode arrives late, by design
                stream = wpb_grpc.DecodeStub(dch).Decode(wpb.DecodeRequest(
                    room=room_a, prefill_addr=p.grpc_addr, token_ids=a_ids, params=params_to_pb(GREEDY)), timeout=30)
                tokens = [t async for c in stream for t in c.token_ids]
                done["A"] = time.monotonic() - t0
                return tokens

            b, a_tokens, a_reply = await asyncio.gather(run_b(), decode_a(), prefill_a)
        return b, a_tokens, a_reply

    b, a_tokens, a_reply = asyncio.run(scenario())
    assert b.ok, (b.prefill_error, b.decode_error)
    assert len(b.tokens) == 4 and len(a_tokens) == 4 and a_reply.first_token == a_tokens[0]
    # B needs 10 chunks of 0.3 s; A two more after B's pages come back. Stuck, both would wait
    # out their 30 s deadline.
    assert done["B"] < 15 and done["A"] < 20, done
    assert done["A"] > done["B"] - 0.5  # A ran once B had given its pages back
    mesh.assert_invariants()
    assert_no_live_handles(p, d)


def _abort(addr: str, stub_cls, room: int) -> None:
    async def call():
        async with channel(addr) as ch:
            return await stub_cls(ch).Abort(wpb.AbortRoomRequest(room=room, reason="test abort"), timeout=5)

    assert asyncio.run(call()).found


@pytest.mark.parametrize("role", [pytest.param("prefill", marks=pytest.mark.long), "decode"])
def test_a_forward_that_fails_after_its_room_was_aborted_frees_the_job(mesh, role):
    faults = ("--faults", "delay_forward=1.5,fail_forward")
    p = mesh.start_prefill(*(faults if role == "prefill" else ()), wait=False)
    d = mesh.start_decode(*(faults if role == "decode" else ()), wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    victim = p if role == "prefill" else d
    stub = wpb_grpc.PrefillStub if role == "prefill" else wpb_grpc.DecodeStub
    room = new_room()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def scenario():
        request = asyncio.ensure_future(
            generate(p.grpc_addr, d.grpc_addr, list(range(40)), params, room=room, timeout=30, cancel_on_failure=False)
        )
        # the room's forward is running (and will raise): abort it from outside, mid-forward
        await asyncio.to_thread(wait_for, lambda: victim.metrics()["pdmesh:num_running_reqs"] == 1, 20,
                                f"{role} forward running")
        await asyncio.to_thread(_abort, victim.grpc_addr, stub, room)
        return await request

    out = asyncio.run(scenario())
    # the forward raised after the abort: the job's pages came back all the same
    wait_for(lambda: "fault injection: fail_forward" in victim.log(), 10, "the injected forward failure")
    mesh.assert_invariants()
    assert_no_live_handles(p, d)
    failed = out.prefill_error if role == "prefill" else out.decode_error
    assert failed is not None and failed.code() == grpc.StatusCode.CANCELLED

@pytest.mark.long

def test_decode_admits_new_requests_once_retracted_ones_resume(mesh):
    # 24 pages of 16 tokens. A (20 + 300 tokens, 20 pages) and B (20 + 200, 14 pages) cannot
    # both grow to their end: B is retracted and resumes only when A finishes. C arrives while
    # B is retracted and must be admitted as soon as B has resumed — not when B finishes.
    # Each decode step takes at least 10 ms, so A cannot finish before B's prefill lands
    # however loaded the machine is (otherwise B never has to be retracted).
    p = mesh.start_prefill(wait=False)
    d = mesh.start_decode("--num-pages", "24", "--page-size", "16", "--faults", "delay_forward=0.01", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    finished_at: dict[str, float] = {}

    async def timed(name, ids, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out = await generate(p.grpc_addr, d.grpc_addr, ids, params, timeout=120)
        finished_at[name] = time.monotonic()
        return out

    async def scenario():
        a = asyncio.ensure_future(timed("A", [5] * 20, 300))
        await asyncio.to_thread(wait_for, lambda: d.metrics()["pdmesh:num_running_reqs"] == 1, 20, "A running")
        b = asyncio.ensure_future(timed("B", [6] * 20, 200))
        # the counter, not the gauge: a poll can miss a short retraction, never a counted one
        await asyncio.to_thread(wait_for, lambda: d.metrics()["pdmesh:num_retracted_requests_total"] >= 1, 60,
                                "B retracted")
        c = asyncio.ensure_future(timed("C", [8] * 10, 3))
        return await asyncio.gather(a, b, c)

    outs = asyncio.run(scenario())
    assert all(o.ok for o in outs), [(o.prefill_error, o.decode_error) for o in outs]
    assert d.metrics()["pdmesh:num_retracted_requests_total"] >= 1
    # B had dozens of tokens left when it resumed; C needed three steps once admitted
    assert finished_at["C"] < finished_at["B"], finished_at
    mesh.assert_invariants()
