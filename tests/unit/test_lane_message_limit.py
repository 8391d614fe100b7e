"""The lane never writes a message past the transport's limit: a batch bigger than the limit goes
out as several messages, and one call too big for any message fails alone (RESOURCE_EXHAUSTED)
while every other call on the same stream succeeds. Real gRPC against the fake workers, whose
servers keep gRPC's default 4 MiB receive limit."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.lane_batches import batches
from tests.unit.test_router_lane import read_all, run_with

pytestmark = pytest.mark.timeout(60)
MIB = 1024 * 1024


def _request(room: int, grammar_bytes: int = 0) -> wpb.PrefillRequest:
    params = wpb.SamplingParams(max_tokens=4)
    if grammar_bytes:
        params.grammar.kind, params.grammar.source = "regex", "a" * grammar_bytes
    return wpb.PrefillRequest(room=room, token_ids=[1, 2, 3], params=params)


def _run(fn, max_message_bytes: int) -> None:
    run_with(lambda p, d, ps, ds: fn(p, ps, ds), max_message_bytes=max_message_bytes)


def test_batches_keep_order_and_bound():
    sizes = [3, 4, 2, 5, 1, 1]
    groups = list(batches(list("abcdef"), sizes, limit=6))
    assert groups == [["a"], ["b", "c"], ["d", "e"], ["f"]]
    assert [e for g in groups for e in g] == list("abcdef")


def test_calls_that_together_pass_the_limit_go_in_several_messages():
    # three 1.5 MiB calls written at once: one message of 4.5 MiB would pass the worker's 4 MiB
    # receive limit and fail the stream with every call on it
    async def fn(p, ps, ds):
        big = [ps.Prefill(_request(room, int(1.5 * MIB)), timeout=20) for room in (1, 2, 3)]
        small = [ps.Prefill(_request(room), timeout=20) for room in range(10, 20)]
        replies = await asyncio.gather(*big, *small)
        assert [r.room for r in replies] == [1, 2, 3, *range(10, 20)]
        assert ps.lane.opened == 1  # the stream never failed

    _run(fn, max_message_bytes=3 * MIB)


def test_one_call_too_big_for_any_message_fails_alone():
    async def fn(p, ps, ds):
        too_big = ps.Prefill(_request(1, 200_000), timeout=20)
        others = [ps.Prefill(_request(room), timeout=20) for room in range(2, 12)]
        streams = [ds.Decode(wpb.DecodeRequest(room=room, token_ids=[1], params=wpb.SamplingParams(max_tokens=3)),
                             timeout=20) for room in range(20, 25)]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await too_big
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "message limit" in e.value.details()
        assert [r.room for r in await asyncio.gather(*others)] == list(range(2, 12))
        for call in streams:
            assert sum(len(c.token_ids) for c in await read_all(call)) == 3
        assert 1 not in p.seen.rooms  # never sent
        assert ps.lane.opened == 1

    _run(fn, max_message_bytes=100_000)


def test_a_reply_too_big_for_any_message_ends_its_call_alone_on_the_worker():
    from services.common.lane_server import _LaneStream

    class Context:
        def __init__(self):
            self.messages: list[wpb.LaneDown] = []

        async def write(self, msg):
            self.messages.append(msg)

    async def main():
        ctx = Context()
        lane = _LaneStream(servicer=None, context=ctx, max_message_bytes=10_000)
        writer = asyncio.ensure_future(lane.write_loop())
        big = wpb.LaneReply(call=1, chunk=wpb.DecodeChunk(token_ids=list(range(100, 20_000))))
        small = [wpb.LaneReply(call=c, chunk=wpb.DecodeChunk(token_ids=[c] * 1500)) for c in range(2, 12)]
        done = lane.emit(big)
        for reply in small:
            lane.emit(reply)
        await asyncio.wait_for(asyncio.shield(done), 5)
        writer.cancel()
        return ctx.messages

    messages = asyncio.run(main())
    assert len(messages) > 1 and all(m.ByteSize() <= 10_000 for m in messages)
    replies = [r for m in messages for r in m.replies]
    assert [r.call for r in replies] == list(range(1, 12))
    assert replies[0].WhichOneof("msg") == "end"
    assert replies[0].end.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert all(r.WhichOneof("msg") == "chunk" for r in replies[1:])
