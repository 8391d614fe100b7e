"""How the router talks to one worker: the `WorkerTransport` interface and its two implementations.

The request logic (services/router/attempt.py) starts a worker's calls as plain grpc.aio calls
through `WorkerHandle.transport` and never learns how they travel:

- `prefill(request, timeout)` → a `PrefillCall`: awaited for its PrefillReply, `cancel()`;
- `decode(request, timeout)` → a `DecodeCall`: `read()` the next DecodeChunk until
  `grpc.aio.EOF`, `cancel()`;
- a failure raises `grpc.aio.AioRpcError` with the status the worker ended the call with (a
  refusal code in its trailing metadata, services/common/refusal.py), whichever transport;
- `load`, `reset_prefix_cache`, `health` (the pool's probes, the cache reset) and `close`.

`RpcTransport` makes each Prefill / Decode one gRPC call. `LaneTransport` (the default,
`--worker-lane`) carries them over the worker's lane, one bidirectional stream multiplexing every
call (services/router/lane.py), and falls back to one RPC per call on a worker without a lane.
`connect` picks one, once per worker, when the pool meets it.

A `DecodeCall.read()` returns an awaitable, not a coroutine the caller must wrap: the lane hands
back a future (already done when a chunk is queued), so the attempt's per-chunk wait costs no
task; an async iterator would cost one per chunk.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
from services.common.grpc_server import internal_channel
from services.router.lane import KEEPALIVE, LaneStub

CHANNEL_OPTIONS = [
    # a worker that comes back must be found quickly, not after gRPC's default backoff (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),  # the router decides about retries itself
]


class PrefillCall(Protocol):
    """grpc.aio's UnaryUnaryCall as the router uses it."""

    def __await__(self) -> Generator[Any, None, wpb.PrefillReply]: ...
    def cancel(self) -> bool: ...


class DecodeCall(Protocol):
    """grpc.aio's UnaryStreamCall as the router uses it."""

    def read(self) -> Awaitable[wpb.DecodeChunk | object]: ...  # grpc.aio.EOF after the last chunk
    def cancel(self) -> bool: ...


class WorkerTransport(Protocol):
    addr: str

    def prefill(self, request: wpb.PrefillRequest, timeout: float | None) -> PrefillCall: ...
    def decode(self, request: wpb.DecodeRequest, timeout: float | None) -> DecodeCall: ...
    def load(self, request: wpb.LoadRequest, timeout: float) -> Awaitable[wpb.LoadReply]: ...
    def reset_prefix_cache(self, timeout: float) -> Awaitable[wpb.ResetPrefixCacheReply]: ...
    def load_lora_adapter(self, name: str, path: str, timeout: float) -> Awaitable[wpb.LoraAdapterReply]: ...
    def unload_lora_adapter(self, name: str, timeout: float) -> Awaitable[wpb.LoraAdapterReply]: ...
    def health(self, timeout: float) -> Awaitable[health_pb2.HealthCheckResponse]: ...
    async def close(self) -> None: ...


class RpcTransport:
    """One gRPC call per Prefill / Decode on the worker's channel (--worker-lane false)."""

    def __init__(self, role: str, addr: str, channel: grpc.aio.Channel):
        self.addr = addr
        self.channel = channel
        self.stub = (wpb_grpc.PrefillStub if role == "prefill" else wpb_grpc.DecodeStub)(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    def prefill(self, request: wpb.PrefillRequest, timeout: float | None) -> PrefillCall:
        return self.stub.Prefill(request, timeout=timeout)

    def decode(self, request: wpb.DecodeRequest, timeout: float | None) -> DecodeCall:
        return self.stub.Decode(request, timeout=timeout)

    def load(self, request: wpb.LoadRequest, timeout: float) -> Awaitable[wpb.LoadReply]:
        return self.stub.Load(request, timeout=timeout)

    def reset_prefix_cache(self, timeout: float) -> Awaitable[wpb.ResetPrefixCacheReply]:
        return self.stub.ResetPrefixCache(wpb.ResetPrefixCacheRequest(), timeout=timeout)

    def load_lora_adapter(self, name: str, path: str, timeout: float) -> Awaitable[wpb.LoraAdapterReply]:
        return self.stub.LoadLoraAdapter(wpb.LoraAdapterRequest(name=name, path=path), timeout=timeout)

    def unload_lora_adapter(self, name: str, timeout: float) -> Awaitable[wpb.LoraAdapterReply]:
        return self.stub.UnloadLoraAdapter(wpb.LoraAdapterRequest(name=name), timeout=timeout)

    def health(self, timeout: float) -> Awaitable[health_pb2.HealthCheckResponse]:
        # the standard grpc.health.v1 check of the whole server (service "")
        return self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close(grace=None)


class LaneTransport(RpcTransport):
    """Prefill / Decode over the worker's lane (services/router/lane.py); the rest as RpcTransport.
    `on_failure(code)`: the lane's stream failed (the worker may be gone)."""

    def __init__(self, role: str, addr: str, channel: grpc.aio.Channel,
                 on_failure: Callable[[grpc.StatusCode], None] | None = None, client: str = "h2",
                 keepalive: tuple[float, float] = KEEPALIVE):
        super().__init__(role, addr, channel)
        self._lane_stub = LaneStub(self.stub, addr, on_failure=on_failure, client=client, keepalive=keepalive)
        self.lane = self._lane_stub.lane

    def prefill(self, request: wpb.PrefillRequest, timeout: float | None) -> PrefillCall:
        return self._lane_stub.Prefill(request, timeout=timeout)

    def decode(self, request: wpb.DecodeRequest, timeout: float | None) -> DecodeCall:
        return self._lane_stub.Decode(request, timeout=timeout)

    async def close(self) -> None:
        await self.lane.close()
        await super().close()


def connect(role: str, addr: str, lane: bool, lane_client: str = "h2",
            keepalive: tuple[float, float] = KEEPALIVE,
            on_failure: Callable[[grpc.StatusCode], None] | None = None) -> WorkerTransport:
    """The worker's channel (keep-alive, the internal token) and its transport; `lane_client`: what
    carries the lane (h2: the router's own HTTP/2 connection, services/router/h2_stream.py; grpc);
    `keepalive`: (time, timeout) in seconds, for the lane and the channel alike."""
    channel = internal_channel(addr, [*CHANNEL_OPTIONS, ("grpc.keepalive_time_ms", int(keepalive[0] * 1000)),
                                      ("grpc.keepalive_timeout_ms", int(keepalive[1] * 1000))])
    if lane:
        return LaneTransport(role, addr, channel, on_failure, lane_client, keepalive)
    return RpcTransport(role, addr, channel)
