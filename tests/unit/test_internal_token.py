"""Internal token, in process (the host tests check it across namespaces): a server built by
new_server() with a token refuses calls without it (UNAUTHENTICATED) on unary and streaming
methods, keeps Health open, and serves channels that present it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_server
from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc


class _Decode(wpb_grpc.DecodeServicer):
    async def Load(self, request, context):
        return wpb.LoadReply(queued=1)

    async def Decode(self, request, context):
        yield wpb.DecodeChunk(token_ids=[7], finish_reason="length")


@pytest.fixture
def token(tmp_path):
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert grpc_server.configure_internal_token(str(f))
    yield "s3cret"
    grpc_server.configure_internal_token("", "")


def test_token_required_on_every_kind_of_call_health_open(token):
    async def main():
        server, health = grpc_server.new_server()
        wpb_grpc.add_DecodeServicer_to_server(_Decode(), server)
        port = grpc_server.bind(server, "127.0.0.1", 0)
        await server.start()
        await grpc_server.set_serving(health)
        addr = f"127.0.0.1:{port}"
        try:
            async with grpc_server.channel(addr, token="") as ch, grpc_server.channel(addr, token="wrong") as bad:
                for c in (ch, bad):
                    stub = wpb_grpc.DecodeStub(c)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Load(wpb.LoadRequest(), timeout=5)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in stub.Decode(wpb.DecodeRequest(room=1), timeout=5):
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc_server.internal_channel(addr) as ch:  # presents the configured token
                stub = wpb_grpc.DecodeStub(ch)
                assert (await stub.Load(wpb.LoadRequest(), timeout=5)).queued == 1
                chunks = [c async for c in stub.Decode(wpb.DecodeRequest(room=1), timeout=5)]
                assert chunks[0].token_ids == [7]
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_no_token_configured_means_no_interceptor():
    grpc_server.configure_internal_token("", "")
    assert grpc_server.internal_token() == ""
    assert grpc_server._interceptors(None) is None
