"""The router's own HTTP/2 gRPC stream (services/router/h2_stream.py) against a real grpc.aio
server: messages both ways across frames and flow-control windows, the server's status and
trailing metadata, an unknown method, cancellation reaching the server, a graceful server
shutdown, a refused connection, and a peer that accepts the connection but never answers
(the keep-alive ends the stream)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.router.h2_stream import H2Stream, encode_headers, host_port

pytestmark = pytest.mark.timeout(60)
ECHO = "/test.Echo/Stream"


def identity(b: bytes) -> bytes:
    return b


class EchoServer:
    """A grpc.aio server whose stream echoes every message; a message b"fail" ends the stream
    with INVALID_ARGUMENT and trailing metadata, b"slow:N" answers N messages 50 ms apart."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.received: list[int] = []  # sizes of the messages the server read

    async def handle(self, request_iterator, context):
        try:
            async for msg in request_iterator:
                self.received.append(len(msg))
                if msg == b"fail":
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad message: 100% wrong",
                                        trailing_metadata=(("why-code", "7"),))
                if msg.startswith(b"slow:"):
                    for i in range(int(msg[5:])):
                        await asyncio.sleep(0.05)
                        yield b"slow %d" % i
                    continue
                yield msg
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def start(self) -> str:
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                               ("grpc.max_send_message_length", 64 << 20)])
        handler = grpc.stream_stream_rpc_method_handler(self.handle)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Stream": handler}),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"


def stream(addr: str, path: str = ECHO, **kw) -> H2Stream:
    opts = dict(max_message_bytes=64 << 20, keepalive_time=2.0, keepalive_timeout=2.0, connect_timeout=2.0)
    opts.update(kw)
    return H2Stream(addr, path, identity, identity, **opts)


def run(fn):
    async def main():
        server = EchoServer()
        addr = await server.start()
        try:
            await fn(server, addr)
        finally:
            await server.server.stop(None)

    asyncio.run(main())


def test_messages_both_ways_across_frames_and_windows():
    async def fn(server, addr):
        s = stream(addr)
        big = bytes(range(256)) * (5 * 4096 + 7)  # 5 MB: over the server's window and many frames each way
        for msg in (b"one", b"", big, b"two"):
            await s.write(msg)
            assert await s.read() == msg
        assert server.received == [3, 0, len(big), 3]
        s.cancel()

    run(fn)


def test_on_messages_hands_each_message_over_as_it_is_parsed_and_read_gives_only_the_end():
    async def fn(server, addr):
        s = stream(addr)
        got: list[bytes] = []
        s.on_messages(got.append)
        big = bytes(range(256)) * (2 * 4096 + 3)  # across many frames
        for msg in (b"one", big, b"two"):
            await s.write(msg)
        end = asyncio.ensure_future(s.read())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        assert got == [b"one", big, b"two"] and not end.done()
        await s.write(b"fail")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(end, 5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(fn)


def test_messages_queued_before_on_messages_go_to_it_first():
    async def fn(server, addr):
        s = stream(addr)
        for msg in (b"first", b"second"):
            await s.write(msg)
        while len(s._messages) < 2:  # both in, queued for read()
            await asyncio.sleep(0.01)
        got: list[bytes] = []
        s.on_messages(got.append)
        await s.write(b"third")
        while len(got) < 3:
            await asyncio.sleep(0.01)
        assert got == [b"first", b"second", b"third"]
        s.cancel()

    run(fn)


def test_the_servers_status_and_trailing_metadata_end_the_stream():
    async def fn(server, addr):
        s = stream(addr)
        await s.write(b"fail")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "bad message: 100% wrong"
        assert ("why-code", "7") in tuple(e.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError):
            await s.write(b"more")  # nothing can be written to a stream that is over

    run(fn)


def test_an_unknown_method_is_unimplemented():
    async def fn(server, addr):
        s = stream(addr, "/test.Echo/Nope")
        await s.write(b"x")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.read()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED

    run(fn)


def test_cancel_reaches_the_server():
    async def fn(server, addr):
        s = stream(addr)
        await s.write(b"slow:100")
        assert await s.read() == b"slow 0"
        assert s.cancel() and not s.cancel()
        await asyncio.wait_for(server.cancelled.wait(), 5)
        with pytest.raises(asyncio.CancelledError):
            await s.read()

    run(fn)


def test_a_graceful_shutdown_lets_the_stream_finish_then_it_fails_unavailable():
    async def fn(server, addr):
        s = stream(addr)
        await s.write(b"slow:4")
        assert await s.read() == b"slow 0"
        stopping = asyncio.ensure_future(server.server.stop(grace=5))  # GOAWAY, then waits for the stream
        got = [await s.read() for _ in range(3)]
        assert got == [b"slow 1", b"slow 2", b"slow 3"]
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the grace cut the stream (it never sent its end)
            await asyncio.wait_for(s.read(), 10)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        await stopping

    run(fn)


def test_a_refused_connection_is_unavailable():
    async def main():
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        s = stream(f"127.0.0.1:{port}")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.write(b"x")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError):
            await s.read()

    asyncio.run(main())


def test_a_peer_that_never_answers_fails_the_stream_by_its_keepalive():
    """A process that accepts the connection and then says nothing (frozen, or a black hole behind
    a proxy): the unanswered keep-alive ping ends the stream, however long nothing else happens."""

    async def main():
        writers = []
        silent = await asyncio.start_server(lambda r, w: writers.append(w), "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        s = stream(f"127.0.0.1:{port}", keepalive_time=0.2, keepalive_timeout=0.3)
        await s.write(b"hello")  # written to the socket: no window is needed for it
        t0 = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(s.read(), 10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "keep-alive" in e.value.details()
        assert loop.time() - t0 < 5
        silent.close()

    asyncio.run(main())


def test_addresses():
    assert host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert host_port("prefill-0.prefill:50051") == ("prefill-0.prefill", 50051)
    assert host_port("[::1]:7000") == ("::1", 7000)
    for other in ("dns:///prefill:50051", "unix:/tmp/sock", "unix:///tmp/s:1", "::1", "host", "host:", ":80"):
        assert host_port(other) is None, other
    with pytest.raises(ValueError):
        H2Stream.__new__(H2Stream).__init__("unix:/tmp/x", ECHO, identity, identity, max_message_bytes=1,
                                            keepalive_time=1, keepalive_timeout=1, connect_timeout=1)


def test_long_header_values_use_multi_byte_lengths():
    import hpack

    token = "t" * 300  # a length over HPACK's 7-bit prefix
    assert hpack.Decoder().decode(encode_headers([("pdmesh-internal-token", token), (":path", ECHO)])) == [
        ("pdmesh-internal-token", token), (":path", ECHO)]


def test_a_message_over_the_receive_limit_ends_the_stream():
    async def fn(server, addr):
        s = stream(addr, max_message_bytes=1000)
        await s.write(b"x" * 1000)
        assert len(await s.read()) == 1000
        await s.write(b"x" * 1001)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    run(fn)

