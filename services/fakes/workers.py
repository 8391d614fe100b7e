"""Scripted in-process prefill/decode gRPC workers, for the router's unit tests and benchmarks.

They speak the real worker.proto and grpc.health.v1, so the router under test runs unmodified;
each fake can be told to fail, hang or stall at a chosen point, and counts what it saw (rooms,
cancellations, streams still open) so tests can assert that the router ended every RPC.

Not used in production. A fake decode "generates" by cycling through `script` (token ids),
honouring max_tokens and stop_token_ids like the real decode, and emits one token per chunk
(`chunk_tokens` > 1: that many per chunk, for tests of multi-token chunks; `coalesce`: as the
real decode does, every token made while the previous chunk was being written goes out in the
next one, for benchmarks).
With `positional` set, the token at absolute position p is script[p % len(script)] (as the real
workers' seeded sampling keys each token by its position), so a request re-submitted with
prompt + generated ids continues the same sequence — what migration relies on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.lane_server import LaneServicerMixin
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION
from services.common.refusal import Refusal, refusal_metadata
from services.decode.jobs import Tokens, coalesce


class _MidStreamFailure(Exception):
    def __init__(self, code: grpc.StatusCode):
        self.code = code


@dataclass
class Behaviour:
    mode: str = "ok"  # ok | fail | hang   (decode also: fail_after | hang_after)
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    after: int = 0  # decode: tokens sent before fail_after/hang_after strikes
    delay: float = 0.0  # prefill: seconds before replying; decode: seconds before the first token
    details: str = ""  # the status details of a failure (default: "fake ... failure")
    token_delay: float = 0.0  # decode: seconds between tokens
    times: int | None = None  # apply the mode this many times, then behave ("ok"); None: always
    keepalive: float = 0.0  # decode: while delaying the first token, send a keep-alive chunk this often
    refusal: Refusal = Refusal.UNSPECIFIED  # "fail": refuse with this reason code, as the real workers do


@dataclass
class Seen:
    rooms: list[int] = field(default_factory=list)
    requests: list = field(default_factory=list)
    cancelled: int = 0  # RPCs that ended because the caller cancelled
    active: int = 0  # RPCs in progress right now
    chunks: int = 0  # decode: DecodeChunks with tokens sent
    tokens: int = 0  # decode: tokens in them


class _FakeHealth(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.frozen = False  # answer nothing (as a SIGSTOPped worker would)

    async def Check(self, request, context):  # noqa: N802 - gRPC method name
        while self.frozen:
            await asyncio.sleep(0.01)
        return health_pb2.HealthCheckResponse(status=self.status)


class FakeWorker:
    role = ""

    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.seen = Seen()
        self.server: grpc.aio.Server | None = None
        self.health = _FakeHealth()
        self.port = 0
        self.lane = True
        # the router-worker protocol versions its Load reports (services/common/mesh_protocol.py)
        self.protocol_version = PROTOCOL_VERSION
        self.min_protocol_version = MIN_PEER_VERSION
        self.load_requests: list = []  # the LoadRequests the router sent (its versions)
        self.prefix_cache_page_size = 0  # what Load reports (0: no prefix cache, the router never matches it)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _mode(self) -> str:
        b = self.behaviour
        if b.mode == "ok" or b.times is None:
            return b.mode
        if b.times <= 0:
            return "ok"
        b.times -= 1
        return b.mode

    def set_serving(self, serving: bool) -> None:
        self.health.status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def start(self) -> None:
        self.server = grpc.aio.server()
        self._register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port or 0}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    def _register(self, server) -> None:
        raise NotImplementedError

    async def Abort(self, request, context):  # noqa: N802
        return wpb.AbortRoomReply(found=False)

    async def Load(self, request, context):  # noqa: N802
        self.load_requests.append(request)
        return wpb.LoadReply(protocol_version=self.protocol_version,
                             min_protocol_version=self.min_protocol_version,
                             prefix_cache_page_size=self.prefix_cache_page_size)

    async def Lane(self, request_iterator, context):  # noqa: N802
        """The lane, as the real workers have it (services/common/lane_server.py); `lane = False`:
        a worker without one (UNIMPLEMENTED, the router then makes one RPC per call)."""
        if not self.lane:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        await LaneServicerMixin.Lane(self, request_iterator, context)


class FakePrefill(FakeWorker, wpb_grpc.PrefillServicer):
    role = "prefill"

    def _register(self, server) -> None:
        wpb_grpc.add_PrefillServicer_to_server(self, server)

    async def Prefill(self, request, context):  # noqa: N802
        self.seen.rooms.append(request.room)
        self.seen.requests.append(request)
        self.seen.active += 1
        try:
            mode = self._mode()
            if self.behaviour.delay:
                await asyncio.sleep(self.behaviour.delay)
            if mode == "fail":
                await context.abort(self.behaviour.code, self.behaviour.details or "fake prefill failure",
                                    trailing_metadata=refusal_metadata(self.behaviour.refusal))
            if mode == "hang":
                await asyncio.Event().wait()
            return wpb.PrefillReply(room=request.room, first_token=0, prompt_tokens=len(request.token_ids))
        except asyncio.CancelledError:
            self.seen.cancelled += 1
            raise
        finally:
            self.seen.active -= 1


class FakeDecode(FakeWorker, wpb_grpc.DecodeServicer):
    role = "decode"

    def __init__(self, script: list[int] | None = None) -> None:
        super().__init__()
        self.script = script or list(b"Hello, world! ")
        self.logprob = -0.5
        self.positional = False
        self.coalesce = False  # True: several tokens per chunk when the reader falls behind (real decode's way)
        self.chunk_tokens = 1  # otherwise: exactly this many tokens per chunk (the last may have fewer)

    def _register(self, server) -> None:
        wpb_grpc.add_DecodeServicer_to_server(self, server)

    async def _tokens(self, request, mode: str):
        """The scripted tokens as jobs.Tokens, one at a time; fail_after aborts, hang_after hangs."""
        b = self.behaviour
        stop_ids = set(request.params.stop_token_ids)
        max_tokens = request.params.max_tokens or 16
        for n in range(1, max_tokens + 1):
            if n > 1 and b.token_delay:
                await asyncio.sleep(b.token_delay)
            if mode == "fail_after" and n > b.after:
                raise _MidStreamFailure(b.code)
            if mode == "hang_after" and n > b.after:
                await asyncio.Event().wait()
            index = len(request.token_ids) + n - 1 if self.positional else n - 1
            token = self.script[index % len(self.script)]
            finish = "stop" if token in stop_ids else ("length" if n == max_tokens else "")
            yield Tokens([token], [self.logprob], finish, n)
            if finish:
                return

    async def _produce(self, request, mode: str, queue: asyncio.Queue) -> None:
        try:
            async for item in self._tokens(request, mode):
                queue.put_nowait(item)
                await asyncio.sleep(0)  # one token per loop turn, as decode steps interleave with writes
        except _MidStreamFailure as e:
            queue.put_nowait(e.code)

    def _chunk(self, request, item: Tokens) -> wpb.DecodeChunk:
        self.seen.chunks += 1
        self.seen.tokens += len(item.token_ids)
        return wpb.DecodeChunk(token_ids=item.token_ids, logprobs=item.logprobs, finish_reason=item.finish_reason,
                               prompt_tokens=len(request.token_ids), completion_tokens=item.completion_tokens)

    async def Decode(self, request, context):  # noqa: N802
        self.seen.rooms.append(request.room)
        self.seen.requests.append(request)
        self.seen.active += 1
        b = self.behaviour
        try:
            mode = self._mode()
            if b.delay and b.keepalive:
                loop = asyncio.get_running_loop()
                until = loop.time() + b.delay
                while loop.time() < until:
                    await asyncio.sleep(min(b.keepalive, max(0.0, until - loop.time())))
                    yield wpb.DecodeChunk(keepalive=True)
            elif b.delay:
                await asyncio.sleep(b.delay)
            if mode == "fail":
                await context.abort(b.code, b.details or "fake decode failure",
                                    trailing_metadata=refusal_metadata(b.refusal))
            if mode == "hang":
                await asyncio.Event().wait()
            if not self.coalesce:
                group: Tokens | None = None  # up to chunk_tokens tokens, sent as one chunk
                try:
                    async for item in self._tokens(request, mode):
                        if group is None:
                            group = item
                        else:
                            group.extend(item)
                        if len(group.token_ids) >= self.chunk_tokens or group.finish_reason:
                            yield self._chunk(request, group)
                            group = None
                except _MidStreamFailure as e:
                    if group is not None:  # as the real decode: tokens made before a failure go out first
                        yield self._chunk(request, group)
                    await context.abort(e.code, "fake decode failure mid-stream")
                return
            # as the real decode's servicer: tokens made while a chunk is being written go out together
            queue: asyncio.Queue = asyncio.Queue()
            producer = asyncio.ensure_future(self._produce(request, mode, queue))
            held = None
            try:
                while True:
                    item, held = (held, None) if held is not None else (await queue.get(), None)
                    if isinstance(item, grpc.StatusCode):
                        await context.abort(item, "fake decode failure mid-stream")
                    item, held = coalesce(item, queue)
                    yield self._chunk(request, item)
                    if item.finish_reason:
                        return
            finally:
                producer.cancel()
        except asyncio.CancelledError:
            self.seen.cancelled += 1
            raise
        finally:
            self.seen.active -= 1


async def _serve(prefill_port: int, decode_port: int) -> None:
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.port, decode.port = prefill_port, decode_port
    await prefill.start()
    await decode.start()
    print(f"fake prefill on {prefill.addr}, fake decode on {decode.addr}", flush=True)
    await asyncio.Event().wait()


def main(argv=None) -> None:
    """`python -m services.fakes.workers --prefill-port P --decode-port D`: instant workers,
    for measuring the router on its own (bench/router_overhead.py)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--prefill-port", type=int, required=True)
    ap.add_argument("--decode-port", type=int, required=True)
    args = ap.parse_args(argv)
    asyncio.run(_serve(args.prefill_port, args.decode_port))


if __name__ == "__main__":
    main()
