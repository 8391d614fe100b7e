"""gRPC server and channel settings shared by every pdmesh process.

Internal channels (router -> workers, decode -> prefill's KVBootstrap) use `internal_channel`:
HTTP/2 keep-alive pings find a connection that died without a reset (a network partition, a
frozen peer) in `KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`, and reconnect attempts are short
and frequent, so once a partition heals the next call finds a fresh connection within about a
second instead of waiting out Linux's TCP retransmission backoff (docs/transfer.md "Across
hosts").

Internal authentication: when a shared token is configured (`configure_internal_token`, from
`--internal-token-file` or `--internal-token` / `PDMESH_INTERNAL_TOKEN`), every server built by `new_server` refuses
any call that does not carry it (UNAUTHENTICATED) except the standard `grpc.health.v1.Health`
service (probes carry no secret and learn only SERVING/NOT_SERVING), and every channel built by
`channel` / `internal_channel` presents it.
"""

from __future__ import annotations

import hmac
import pathlib
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # long prompts travel as token lists
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Servers accept keepalive pings every second even without calls (and never count them as
# abuse), so a client's keepalive is never answered with GOAWAY "too_many_pings".
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC sets SO_REUSEPORT by default: a second worker on a taken port would then bind too, and
    # the kernel would split the router's connections between the two
    ("grpc.so_reuseport", 0),
]
KEEPALIVE_TIME_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
INTERNAL_CHANNEL_OPTIONS = [
    *OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect quickly after a partition heals: gRPC's default backoff grows to 120 s, and its
    # default connect deadline (20 s) lets one lost SYN hold the channel for seconds
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

TOKEN_KEY = "pdmesh-internal-token"  # gRPC metadata key carrying the shared secret
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
_token: str = ""


def configure_internal_token(token_file: str = "", token: str = "") -> bool:
    """Set the process's internal token: the content of `token_file` (stripped; a file that is
    missing or empty is waited for, up to TOKEN_FILE_WAIT seconds, then an error), else `token` (--internal-token / PDMESH_INTERNAL_TOKEN); neither: no
    authentication. Call once at start, before building any server or channel. Returns whether a
    token is in force."""
    global _token
    _token = (_wait_for_file(pathlib.Path(token_file)).read_text() if token_file else token).strip()
    return bool(_token)


TOKEN_FILE_WAIT = 60.0  # seconds: compose's one-shot token service may write it just after we start


def _wait_for_file(path: pathlib.Path, timeout: float = TOKEN_FILE_WAIT) -> pathlib.Path:
    """`path` once it exists and is not empty; FileNotFoundError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size > 0):
        if time.monotonic() >= deadline:
            raise FileNotFoundError(f"internal token file {path} still missing or empty after {timeout:g} s")
        time.sleep(0.2)
    return path


def internal_token() -> str:
    return _token


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong internal token")
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the shared token, Health excepted."""

    def __init__(self, token: str):
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        given = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_KEY:
                given = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self._token):
            return handler
        return _deny(handler)


class _TokenMetadata:
    def __init__(self, token: str):
        self._md = (TOKEN_KEY, token)

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(tuple(d.metadata or ())), self._md)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


# one class per call kind: grpc.aio files an interceptor under the first kind it matches
class _TokenUnaryUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _TokenUnaryStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def new_server() -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    interceptors = [TokenAuthInterceptor(_token)] if _token else None
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
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


def _interceptors(token: str | None) -> list | None:
    token = _token if token is None else token
    return [_TokenUnaryUnary(token), _TokenUnaryStream(token)] if token else None


def channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A plain channel (tests, tools); presents the internal token when one is configured
    (or the `token` given; "" presents none)."""
    return grpc.aio.insecure_channel(address, options=OPTIONS, interceptors=_interceptors(token))


def internal_channel(address: str, options: list | None = None) -> grpc.aio.Channel:
    """A long-lived channel between pdmesh processes: keep-alive, fast reconnect, the token."""
    opts = dict(INTERNAL_CHANNEL_OPTIONS)
    opts.update(dict(options or ()))
    return grpc.aio.insecure_channel(address, options=list(opts.items()), interceptors=_interceptors(None))
