"""Decode's servicer over real gRPC: tokens already queued when the stream gets to them go out as
one DecodeChunk (per-token lists aligned, completion_tokens the total), a failure queued behind
tokens comes after them. The worker is a stand-in that queues what the engine would have."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.decode.jobs import DecodeFailed, Tokens
from services.decode.servicer import DecodeServicer

pytestmark = pytest.mark.timeout(30)


class QueuedWorker:
    """submit() returns a job whose queue already holds `items`."""

    def __init__(self, items: list):
        self.items = items
        self.aborted: list[int] = []
        config = SimpleNamespace(vocab_size=512, max_position_embeddings=4096, max_model_len=4096)
        self.engine = SimpleNamespace(config=config, pool=SimpleNamespace(can_ever_hold=lambda n: True),
                                      check_grammar=lambda params: None, check_lora=lambda params: None)

    def submit(self, room, token_ids, params, prefill_addr, canary=False):
        out: asyncio.Queue = asyncio.Queue()
        for item in self.items:
            out.put_nowait(item)
        self.job = SimpleNamespace(out=out, usage_cached_tokens=0, prompt_lp=None)
        return self.job

    def is_computing(self, job) -> bool:
        return True

    def abort(self, room: int, reason: str) -> bool:
        self.aborted.append(room)
        return True


async def decode_stream(worker: QueuedWorker) -> tuple[list, grpc.aio.AioRpcError | None]:
    server = grpc.aio.server()
    wpb_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    chunks, error = [], None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = wpb_grpc.DecodeStub(channel).Decode(wpb.DecodeRequest(
                room=7, token_ids=[1, 2, 3], prefill_addr="127.0.0.1:1",
                params=wpb.SamplingParams(max_tokens=8)))
            try:
                async for chunk in call:
                    chunks.append(chunk)
            except grpc.aio.AioRpcError as e:
                error = e
    finally:
        await server.stop(None)
    return chunks, error


def tokens(t: int, n: int, finish: str = "") -> Tokens:
    return Tokens([t], [-0.1 * n], finish, n)


def test_queued_tokens_go_out_in_one_chunk():
    worker = QueuedWorker([tokens(40, 1), tokens(41, 2), tokens(42, 3), tokens(43, 4, "length")])
    chunks, error = asyncio.run(decode_stream(worker))
    assert error is None and len(chunks) == 1
    (c,) = chunks
    assert list(c.token_ids) == [40, 41, 42, 43] and len(c.logprobs) == 4
    assert c.finish_reason == "length" and c.completion_tokens == 4 and c.prompt_tokens == 3
    assert worker.aborted == []


def test_a_failure_behind_tokens_comes_after_them():
    worker = QueuedWorker([tokens(40, 1), tokens(41, 2), DecodeFailed("pages lost", "INTERNAL")])
    chunks, error = asyncio.run(decode_stream(worker))
    assert [list(c.token_ids) for c in chunks] == [[40, 41]]
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL and "pages lost" in error.details()


def test_a_cancel_that_lands_with_a_token_aborts_the_room():
    """The caller cancels in the same loop turn as a token arrives (client disconnect mid-stream):
    the cancellation must reach the servicer, which aborts the room; it must not be lost to the
    token (Python 3.11's asyncio.wait_for returns the result and drops the cancel)."""

    async def scenario() -> tuple[list[int], bool]:
        worker = QueuedWorker([tokens(40, 1)])
        request = wpb.DecodeRequest(room=7, token_ids=[1, 2, 3], prefill_addr="127.0.0.1:1",
                                    params=wpb.SamplingParams(max_tokens=8))
        gen = DecodeServicer(worker, keepalive_interval=30).Decode(request, None)
        first = await gen.__anext__()
        assert list(first.token_ids) == [40]
        reader = asyncio.ensure_future(gen.__anext__())
        for _ in range(5):  # the servicer now waits on the empty queue
            await asyncio.sleep(0)
        worker.job.out.put_nowait(tokens(41, 2))
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            cancelled = True
        else:
            cancelled = False
        return worker.aborted, cancelled

    aborted, cancelled = asyncio.run(scenario())
    assert cancelled, "the cancel was swallowed: the servicer went on to the next token"
    assert aborted == [7]
