"""gRPC server and channel settings shared by every pdmesh process."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # long prompts travel as token lists
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Servers accept keepalive pings every 5 s even without calls, so a client's keepalive (which
# detects a frozen peer on an idle connection) is never answered with GOAWAY "too_many_pings".
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def new_server() -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise OSError(f"cannot bind gRPC to {host}:{port}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port} (in use?)")
    return bound


async def set_serving(health_servicer: health.aio.HealthServicer, *services: str) -> None:
    for name in ("", *services):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def set_not_serving(health_servicer: health.aio.HealthServicer, *services: str) -> None:
    for name in ("", *services):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)
