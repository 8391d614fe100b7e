"""The lane (services/router/lane.py, services/common/lane_server.py): Prefill / Decode calls
multiplexed over one stream per worker behave as one gRPC call each — replies, chunks, statuses,
deadlines, cancellation reaching the worker's servicer, a worker that dies or restarts, a worker
without the lane, the internal token — against the scripted fake workers (real gRPC)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common import grpc_server
from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.fakes.workers import FakeDecode, FakePrefill
from services.router.lane import LaneStub

pytestmark = pytest.mark.timeout(60)
PARAMS = wpb.SamplingParams(max_tokens=4)


def prefill_request(room: int) -> wpb.PrefillRequest:
    return wpb.PrefillRequest(room=room, token_ids=[1, 2, 3], params=PARAMS)


def decode_request(room: int, max_tokens: int = 4) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(room=room, prefill_addr="127.0.0.1:1", token_ids=[1, 2, 3],
                             params=wpb.SamplingParams(max_tokens=max_tokens))


async def read_all(call) -> list[wpb.DecodeChunk]:
    chunks = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        chunks.append(msg)
    return chunks


async def wait_until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while not cond():
        assert loop.time() < until, "condition not reached"
        await asyncio.sleep(0.01)


def run_with(fn, *, prefill_lane: bool = True, **stub_kw):
    """Run `fn(prefill, decode, prefill_stub, decode_stub)` against fresh fakes on real gRPC
    (`stub_kw`: LaneStub's options, e.g. max_message_bytes)."""

    async def main():
        p, d = FakePrefill(), FakeDecode()
        p.lane = prefill_lane
        await p.start()
        await d.start()
        pch, dch = grpc.aio.insecure_channel(p.addr), grpc.aio.insecure_channel(d.addr)
        ps = LaneStub(wpb_grpc.PrefillStub(pch), p.addr, **stub_kw)
        ds = LaneStub(wpb_grpc.DecodeStub(dch), d.addr, **stub_kw)
        try:
            await fn(p, d, ps, ds)
        finally:
            await ps.lane.close()
            await ds.lane.close()
            await pch.close()
            await dch.close()
            await p.stop()
            await d.stop()

    asyncio.run(main())


def test_many_concurrent_calls_share_one_stream():
    async def fn(p, d, ps, ds):
        async def one(room: int):
            reply = await ps.Prefill(prefill_request(room), timeout=10)
            chunks = await read_all(ds.Decode(decode_request(room), timeout=10))
            return reply, chunks

        results = await asyncio.gather(*(one(room) for room in range(1, 41)))
        for room, (reply, chunks) in enumerate(results, start=1):
            assert reply.room == room and reply.prompt_tokens == 3
            assert [t for c in chunks for t in c.token_ids] == list(b"Hell")
            assert chunks[-1].finish_reason == "length"
        assert ps.lane.opened == 1 and ds.lane.opened == 1
        assert sorted(p.seen.rooms) == list(range(1, 41)) and p.seen.active == 0 and d.seen.active == 0

    run_with(fn)


def test_worker_statuses_arrive_as_rpc_errors_tokens_first():
    async def fn(p, d, ps, ds):
        p.behaviour.mode, p.behaviour.code = "fail", grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ps.Prefill(prefill_request(1), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == "fake prefill failure"
        d.behaviour.mode, d.behaviour.after = "fail_after", 2
        call = ds.Decode(decode_request(2), timeout=10)
        got = [(await call.read()).token_ids[0], (await call.read()).token_ids[0]]
        assert got == list(b"He")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # the lane itself is fine: the next call on it succeeds
        d.behaviour.mode = "ok"
        assert len(await read_all(ds.Decode(decode_request(3), timeout=10))) == 4
        assert ds.lane.opened == 1

    run_with(fn)


def test_deadline_fails_the_call_and_cancels_it_on_the_worker():
    async def fn(p, d, ps, ds):
        p.behaviour.mode = "hang"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ps.Prefill(prefill_request(1), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: p.seen.cancelled == 1 and p.seen.active == 0)
        d.behaviour.mode, d.behaviour.after = "hang_after", 1
        call = ds.Decode(decode_request(2), timeout=0.3)
        assert list((await call.read()).token_ids) == [72]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: d.seen.cancelled == 1 and d.seen.active == 0)

    run_with(fn)


def test_cancel_reaches_the_servicer():
    async def fn(p, d, ps, ds):
        d.behaviour.mode, d.behaviour.after = "hang_after", 2
        call = ds.Decode(decode_request(1), timeout=10)
        await call.read()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        await wait_until(lambda: d.seen.cancelled == 1 and d.seen.active == 0)
        # a task awaiting a Prefill call is cancelled: the call ends on the worker too
        p.behaviour.mode = "hang"
        task = asyncio.ensure_future(_await(ps.Prefill(prefill_request(2), timeout=10)))
        await wait_until(lambda: p.seen.active == 1)
        task.cancel()
        await wait_until(lambda: p.seen.cancelled == 1 and p.seen.active == 0)

    run_with(fn)


async def _await(call):
    return await call


def test_a_reader_that_falls_behind_gets_bigger_chunks():
    async def fn(p, d, ps, ds):
        d.coalesce = True  # as the real decode's servicer
        call = ds.Decode(decode_request(1, max_tokens=200), timeout=10)
        await asyncio.sleep(0.3)  # not reading: the worker waits for each write, tokens pile up
        chunks = await read_all(call)
        assert sum(len(c.token_ids) for c in chunks) == 200
        assert len(chunks) < 200

    run_with(fn)


def test_worker_gone_fails_calls_then_a_restarted_worker_gets_a_new_stream():
    async def fn(p, d, ps, ds):
        d.behaviour.mode = "hang"
        call = ds.Decode(decode_request(1), timeout=10)
        await wait_until(lambda: d.seen.active == 1)
        port = d.port
        await d.stop()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        d.behaviour.mode = "ok"
        d.port = port
        await d.start()
        loop = asyncio.get_running_loop()
        until = loop.time() + 10
        while True:  # the channel reconnects within its backoff; until then calls fail fast
            try:
                chunks = await read_all(ds.Decode(decode_request(2), timeout=5))
                break
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE and loop.time() < until
                await asyncio.sleep(0.1)
        assert len(chunks) == 4 and ds.lane.opened >= 2

    run_with(fn)


def test_router_closing_its_lane_cancels_every_call_on_the_worker():
    async def fn(p, d, ps, ds):
        d.behaviour.mode = "hang"
        calls = [ds.Decode(decode_request(room), timeout=10) for room in range(1, 6)]
        await wait_until(lambda: d.seen.active == 5)
        await ds.lane.close()
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        await wait_until(lambda: d.seen.active == 0 and d.seen.cancelled == 5)

    run_with(fn)


def test_worker_side_timeout_holds_without_the_router():
    """The worker keeps each call's timeout itself: a router that froze still has its rooms ended."""

    async def main():
        p = FakePrefill()
        p.behaviour.mode = "hang"
        await p.start()
        async with grpc.aio.insecure_channel(p.addr) as ch:
            stream = wpb_grpc.PrefillStub(ch).Lane()
            await stream.write(wpb.LaneUp(calls=[wpb.LaneCall(call=1, prefill=prefill_request(1), timeout=0.3)]))
            await wait_until(lambda: p.seen.cancelled == 1 and p.seen.active == 0)
            # a cancel entry for a call that is over, an unknown op, a repeated id: answered, no crash
            await stream.write(wpb.LaneUp(calls=[wpb.LaneCall(call=1, cancel=True), wpb.LaneCall(call=2)]))
            msg = await stream.read()
            assert msg.replies[0].call == 2 and msg.replies[0].end.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
            stream.cancel()
        await p.stop()

    asyncio.run(main())


def test_worker_without_a_lane_gets_one_rpc_per_call():
    async def fn(p, d, ps, ds):
        first = await asyncio.gather(*(_await(ps.Prefill(prefill_request(room), timeout=10)) for room in (1, 2, 3)))
        assert [r.room for r in first] == [1, 2, 3]
        assert not ps.lane.supported
        assert (await ps.Prefill(prefill_request(4), timeout=10)).room == 4
        assert sorted(p.seen.rooms) == [1, 2, 3, 4]
        assert ds.lane.supported  # decode has one

    run_with(fn, prefill_lane=False)


def test_lane_presents_the_internal_token(tmp_path):
    f = tmp_path / "token"
    f.write_text("s3cret")
    grpc_server.configure_internal_token(str(f))

    class Decode(wpb_grpc.DecodeServicer):
        async def Decode(self, request, context):  # noqa: N802
            yield wpb.DecodeChunk(token_ids=[7], finish_reason="length")

    from services.common.lane_server import LaneServicerMixin

    class LaneDecode(LaneServicerMixin, Decode):
        pass

    async def main():
        server, _ = grpc_server.new_server()
        wpb_grpc.add_DecodeServicer_to_server(LaneDecode(), server)
        addr = f"127.0.0.1:{grpc_server.bind(server, '127.0.0.1', 0)}"
        await server.start()
        try:
            async with grpc_server.internal_channel(addr) as ch:
                stub = LaneStub(wpb_grpc.DecodeStub(ch), addr)
                chunks = await read_all(stub.Decode(decode_request(1), timeout=5))
                assert [list(c.token_ids) for c in chunks] == [[7]]
                await stub.lane.close()
            grpc_server.configure_internal_token("", "wrong")
            async with grpc_server.internal_channel(addr) as ch:
                stub = LaneStub(wpb_grpc.DecodeStub(ch), addr)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await read_all(stub.Decode(decode_request(2), timeout=5))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await stub.lane.close()
        finally:
            await server.stop(None)

    try:
        asyncio.run(main())
    finally:
        grpc_server.configure_internal_token("", "")


def test_cancelling_one_call_leaves_the_others_on_the_lane_alone():
    """Calls whose replies share one message each wait for it on their own: cancelling one while
    it waits must not cancel the wait of the others (found by the chaos soak)."""

    async def fn(p, d, ps, ds):
        calls = [ds.Decode(decode_request(room, max_tokens=300), timeout=20) for room in range(1, 9)]
        for call in calls:
            await call.read()
        for victim in calls[:4]:
            victim.cancel()
            await asyncio.sleep(0)
        for call in calls[4:]:
            rest = await read_all(call)
            assert sum(len(c.token_ids) for c in rest) == 299
        await wait_until(lambda: d.seen.active == 0)
        assert d.seen.cancelled == 4

    run_with(fn)


def test_a_worker_that_dies_is_reported_by_its_idle_lane():
    """The lane is a connection held open: the pool hears of a killed worker at once, before any
    request of its own fails there (it then probes the worker and ejects it)."""

    async def main():
        p = FakePrefill()
        await p.start()
        reported: list[grpc.StatusCode] = []
        async with grpc.aio.insecure_channel(p.addr) as ch:
            stub = LaneStub(wpb_grpc.PrefillStub(ch), p.addr, on_failure=reported.append)
            assert (await stub.Prefill(prefill_request(1), timeout=5)).room == 1
            await p.stop()
            await wait_until(lambda: reported == [grpc.StatusCode.UNAVAILABLE])
            await stub.lane.close()  # the router's own close is not a failure
            assert reported == [grpc.StatusCode.UNAVAILABLE]

    asyncio.run(main())


@pytest.mark.parametrize("how", ["flag_off", "workers_without_lane"])
def test_router_without_the_lane_serves_and_fails_over_the_same(how):
    """One RPC per call (--worker-lane false, or workers that have no Lane method): the same
    answers, and a failing decode still fails over before the first byte."""
    from tests.unit.test_router_app import Cluster, completion, post, sse_payloads

    c = Cluster(n_decode=2, **({"worker_lane": False} if how == "flag_off" else {}))
    try:
        if how == "workers_without_lane":
            for w in (*c.prefills, *c.decodes):
                w.lane = False
        r = post(c, "/v1/completions", completion(max_tokens=5))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "Hello"
        c.decodes[0].behaviour.mode = c.decodes[1].behaviour.mode = "fail"
        c.decodes[0].behaviour.times = c.decodes[1].behaviour.times = 1
        r = post(c, "/v1/completions", completion(max_tokens=5, stream=True))
        assert r.status_code == 200, r.text
        events = sse_payloads(r.text)
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == "Hello"
        stubs = [w.transport for w in c.router.pool.workers]
        if how == "flag_off":
            assert not any(hasattr(s, "lane") for s in stubs)
        else:
            assert all(not s.lane.supported for s in stubs if s.lane.opened)
            assert not c.prefills[0].seen.active and sum(s.lane.opened for s in stubs) >= 2
    finally:
        c.close()


def test_a_stopping_worker_refuses_new_calls_on_an_open_lane():
    """During a graceful stop the gRPC server refuses new RPCs; an open lane must refuse new
    calls the same way (UNAVAILABLE at once), while the calls already running go on."""
    from services.common import lane_server

    async def fn(p, d, ps, ds):
        d.behaviour.token_delay = 0.05
        running = ds.Decode(decode_request(1), timeout=10)
        await running.read()
        lane_server.refuse_new_calls("decode worker stopping")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await read_all(ds.Decode(decode_request(2), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in e.value.details()
            assert sum(len(c.token_ids) for c in await read_all(running)) == 3
        finally:
            lane_server.refuse_new_calls("")
        assert ds.lane.opened == 1

    run_with(fn)


FROZEN_WORKER = """
import asyncio, sys
from services.fakes.workers import FakeDecode

async def main():
    d = FakeDecode()
    d.behaviour.mode = "hang"  # the call stays open, silent, until the worker ends it
    await d.start()
    print(d.port, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_sigstopped_worker_fails_its_calls_within_the_keepalive():
    """A worker process that is SIGSTOPped with a call open on its lane (its TCP connection looks
    fine, the call's deadline is a minute away): the lane's unanswered keep-alive ping fails the
    call with UNAVAILABLE within keep-alive time + timeout, and tells the pool. (On a grpc.aio
    stream, --worker-lane-client grpc, the same call was still open a minute later.)"""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", FROZEN_WORKER], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())

    async def main():
        port = int(proc.stdout.readline())
        failures = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            ds = LaneStub(wpb_grpc.DecodeStub(ch), f"127.0.0.1:{port}", on_failure=failures.append,
                          keepalive=(0.5, 0.5))
            call = ds.Decode(decode_request(1), timeout=60)
            loop = asyncio.get_running_loop()
            await asyncio.sleep(1.5)  # pings answered meanwhile: the lane stays
            assert not call.done and ds.lane.opened == 1
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = loop.time()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await asyncio.wait_for(call.read(), 30)
            took = loop.time() - t0
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "keep-alive" in e.value.details()
            assert took < 5, took  # 0.5 s quiet + 0.5 s for the answer, with room for a loaded machine
            assert failures == [grpc.StatusCode.UNAVAILABLE]
            await ds.lane.close()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(10)


def test_calls_of_one_loop_iteration_go_out_in_one_message_without_the_write_loop():
    """The entries started in one loop iteration are written together, straight from the loop's
    callback when the stream takes them without waiting (H2Stream.try_write)."""
    async def fn(p, d, ps, ds):
        await ps.Prefill(prefill_request(100), timeout=10)  # the stream is open and ready
        stream = ps.lane._stream
        direct, waited = [], []
        try_write, write = stream.try_write, stream.write

        def counting_try_write(message):
            ok = try_write(message)
            (direct if ok else waited).append(len(message.calls))
            return ok

        async def counting_write(message):
            waited.append(len(message.calls))
            await write(message)

        stream.try_write, stream.write = counting_try_write, counting_write
        calls = [ps.Prefill(prefill_request(room), timeout=10) for room in range(1, 9)]
        replies = await asyncio.gather(*calls)
        assert [r.room for r in replies] == list(range(1, 9))
        assert direct == [8] and waited == []

    run_with(fn)


def test_calls_beyond_the_window_wait_for_it_in_their_order():
    """Calls whose bytes pass HTTP/2's flow-control window: those the stream cannot take at once go
    through the write loop, after the ones written, and every call is answered in the order sent."""
    async def fn(p, d, ps, ds):
        await ps.Prefill(prefill_request(1000), timeout=10)
        big = list(range(3000))  # ~6 KB an entry: 64 entries are several windows
        rooms = list(range(1, 65))
        for room in rooms[:32]:  # two loop iterations' worth, the second sent while the first waits
            ps.Prefill(wpb.PrefillRequest(room=room, token_ids=big, params=PARAMS), timeout=20)
        await asyncio.sleep(0)
        calls = [ps.Prefill(wpb.PrefillRequest(room=room, token_ids=big, params=PARAMS), timeout=20)
                 for room in rooms[32:]]
        await asyncio.gather(*calls)
        await wait_until(lambda: len(p.seen.rooms) == 65)
        assert p.seen.rooms[1:] == rooms

    run_with(fn, max_message_bytes=16 * 1024)


def test_replies_reach_their_calls_as_the_stream_parses_them_without_the_read_loop():
    """The stream hands each message to the lane from the connection's callback
    (H2Stream.on_messages): the read loop only waits for the stream's end."""
    async def fn(p, d, ps, ds):
        await ps.Prefill(prefill_request(100), timeout=10)  # the stream is open
        stream = ps.lane._stream
        read = stream.read
        reads: list[object] = []

        def counting_read():
            fut = read()
            reads.append(fut)
            return fut

        stream.read = counting_read
        replies = await asyncio.gather(*(ps.Prefill(prefill_request(room), timeout=10) for room in range(1, 6)))
        assert [r.room for r in replies] == list(range(1, 6))
        assert reads == []  # the read loop still waits on its first read(), for the end

    run_with(fn)


def test_a_reply_the_lane_cannot_deliver_ends_the_lane_and_fails_its_calls():
    async def fn(p, d, ps, ds):
        await ps.Prefill(prefill_request(100), timeout=10)
        lane = ps.lane
        deliver = lane._deliver

        def broken(msg):
            raise RuntimeError("cannot deliver")

        lane._deliver = broken
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ps.Prefill(prefill_request(1), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "read failed" in e.value.details()
        lane._deliver = deliver
        assert (await ps.Prefill(prefill_request(2), timeout=10)).room == 2  # a new stream serves the next

    run_with(fn)
