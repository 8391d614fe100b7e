"""Whether a port is free to listen on (services/common/listening.py), and gRPC servers that do
not share a taken port."""

from __future__ import annotations

import asyncio

import pytest

from services.common.grpc_server import bind, new_server
from services.common.listening import listening_socket, port_taken
from services.launch.ports import free_port


def test_a_port_is_taken_while_a_socket_listens_on_it_and_free_after():
    port = free_port()
    assert port_taken("127.0.0.1", port) is None
    for reuse_port in (False, True):  # also a router process's socket, which shares with its siblings only
        with listening_socket("127.0.0.1", port, reuse_port=reuse_port) as held:
            held.listen()
            assert "in use" in port_taken("127.0.0.1", port)
        assert port_taken("127.0.0.1", port) is None


def test_port_zero_is_always_free():
    assert port_taken("127.0.0.1", 0) is None


def test_a_second_grpc_server_cannot_bind_a_worker_s_port():
    # gRPC's servers set SO_REUSEPORT unless told not to; then both would bind, and the kernel
    # would split the router's connections between the two processes
    async def scenario():
        first, _ = new_server()
        second, _ = new_server()
        port = free_port()
        try:
            assert bind(first, "127.0.0.1", port) == port
            await first.start()
            with pytest.raises(OSError, match="cannot bind gRPC"):
                bind(second, "127.0.0.1", port)
        finally:
            await first.stop(None)
            await second.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))
