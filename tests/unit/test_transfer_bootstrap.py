"""The gRPC bootstrap (grpc.aio, in-process, 127.0.0.1) over fake NIXL agents: version checks,
error kinds, re-registration and heartbeat-driven failures. Real NIXL: tests/integration."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import pytest

from services.common.generated.pdmesh.v1 import bootstrap_pb2 as pb
from services.common.generated.pdmesh.v1 import bootstrap_pb2_grpc as pb_grpc
from services.transfer import bootstrap as bs
from services.transfer.receiver import KVReceiver
from services.transfer.sender import KVSender
from services.transfer.state import RoomState
from services.transfer.wire_format import PROTOCOL_VERSION, AuxRow, KVNotification, ProtocolMismatch
from tests.unit.test_transfer_managers import FakeAgent, Pool

pytestmark = pytest.mark.timeout(30)


async def _serve(sender):
    server = grpc.aio.server()
    bs.add_bootstrap_servicer(server, sender)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _pair():
    sender = KVSender(FakeAgent("P", 500, 0, 100_000), Pool())
    rx_agent = FakeAgent("D1", 10, 1_000_000, 2_000_000)
    return sender, KVReceiver(rx_agent, Pool()), rx_agent


@dataclass
class _Bootstrapped:
    sender: KVSender
    rx: KVReceiver
    rx_agent: FakeAgent
    server: grpc.aio.Server  # a test that restarts prefill puts the new server here
    addr: str
    coord: bs.KVReceiveCoordinator


@contextlib.asynccontextmanager
async def _bootstrapped(**coordinator_options):
    """A sender served over gRPC and a decode-side coordinator attached to it; both closed after."""
    sender, rx, rx_agent = _pair()
    server, addr = await _serve(sender)
    coord = bs.KVReceiveCoordinator(rx, "decode-0", **{"rpc_timeout": 2, **coordinator_options})
    b = _Bootstrapped(sender, rx, rx_agent, server, addr, coord)
    try:
        yield b
    finally:
        await b.coord.close()
        await b.server.stop(None)  # a no-op for a server the test already stopped


def _runs_bootstrapped(**coordinator_options):
    """Turns `async def test_x(b)` into a plain test that runs it on a fresh _bootstrapped() pair."""

    def decorate(body):
        def test():
            async def main():
                async with _bootstrapped(**coordinator_options) as b:
                    await body(b)

            asyncio.run(main())

        test.__name__, test.__doc__ = body.__name__, body.__doc__
        return test

    return decorate


@_runs_bootstrapped()
async def test_register_attach_heartbeat_abort_roundtrip(b):
    sender, rx, coord, addr = b.sender, b.rx, b.coord, b.addr
    rx.create_room(1, addr)
    assert await coord.attach(1, addr, [3, 4])
    r = rx.rooms.get(1)
    assert r.state == RoomState.WAITING_FOR_INPUT and (r.sender_agent, r.sender_epoch) == ("P", 500)
    assert sender.num_pending_attach == 1  # Prefill RPC not there yet
    sender.create_room(1)
    sender.send(1, [0, 1], 9, -0.5)
    await coord.heartbeat_once()
    assert r.state == RoomState.TRANSFERRING  # forward done -> phase 2
    rx.create_room(2, addr)
    assert await coord.attach(2, addr, [5])
    sender.abort(2, "router cancelled")  # prefill drops it ...
    await coord.heartbeat_once()
    assert rx.rooms.get(2).state == RoomState.FAILED  # ... decode learns at the next heartbeat
    rx.create_room(3, addr)
    await coord.attach(3, addr, [6])
    await coord.abort(3, "client went away")
    assert sender.rooms.outcome(3) == RoomState.FAILED and rx.rooms.get(3).state == RoomState.FAILED


def test_version_mismatch_refused_with_both_versions():
    async def main():
        sender, rx, _ = _pair()
        server, addr = await _serve(sender)
        try:
            async with grpc.aio.insecure_channel(addr) as ch:
                stub = pb_grpc.KVBootstrapStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Heartbeat(pb.HeartbeatRequest(protocol_version=PROTOCOL_VERSION + 7))
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"version {PROTOCOL_VERSION + 7}" in e.value.details()
                assert f"version {PROTOCOL_VERSION}" in e.value.details()
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_client_refuses_a_server_with_another_version():
    class OldServer(pb_grpc.KVBootstrapServicer):
        async def RegisterPeer(self, request, context):
            return pb.RegisterPeerReply(protocol_version=PROTOCOL_VERSION + 1)

        async def Attach(self, request, context):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "speaks another version",
                trailing_metadata=(
                    (bs.ERROR_KEY, "version-mismatch"),
                    (bs.VERSION_KEY, str(PROTOCOL_VERSION + 1)),
                ),
            )

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_KVBootstrapServicer_to_server(OldServer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = bs.BootstrapClient(f"127.0.0.1:{port}", timeout=2)
        _, rx, agent = _pair()
        try:
            with pytest.raises(ProtocolMismatch) as e:
                await client.register_peer("d", "D1", 10, b"D1", agent.layout)
            assert e.value.remote == PROTOCOL_VERSION + 1 and e.value.local == PROTOCOL_VERSION
            rx.create_room(1, "x")
            with pytest.raises(ProtocolMismatch, match=f"version {PROTOCOL_VERSION + 1}"):
                await client.attach(rx.prepare_attach(1, [0]))
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(main())


@_runs_bootstrapped()
async def test_reregisters_after_prefill_restart(b):
    rx, coord, addr = b.rx, b.coord, b.addr
    rx.create_room(1, addr)
    assert await coord.attach(1, addr, [1])
    # prefill restarts on the same address: new agent, new epoch, no peers
    await b.server.stop(None)
    sender2 = KVSender(FakeAgent("P2", 600, 0, 100_000), Pool())
    b.server = grpc.aio.server()
    bs.add_bootstrap_servicer(b.server, sender2)
    b.server.add_insecure_port(addr)
    await b.server.start()
    await coord.heartbeat_once()
    r1 = rx.rooms.get(1)
    assert r1.state == RoomState.FAILED and "restarted" in r1.reason
    rx.create_room(2, addr)
    assert await coord.attach(2, addr, [2])  # peer-not-registered -> RegisterPeer -> retry
    assert rx.rooms.get(2).sender_epoch == 600


@_runs_bootstrapped(rpc_timeout=0.5, heartbeat_interval=0.1, heartbeat_max_failures=3)
async def test_unreachable_prefill_fails_its_rooms_after_max_heartbeat_failures(b):
    rx, coord, addr = b.rx, b.coord, b.addr
    rx.create_room(1, addr)
    assert await coord.attach(1, addr, [1])
    await b.server.stop(None)
    for _ in range(2):
        await coord.heartbeat_once()
    assert rx.rooms.get(1).state == RoomState.WAITING_FOR_INPUT
    await coord.heartbeat_once()
    assert rx.rooms.get(1).state == RoomState.FAILED and "unreachable" in rx.rooms.get(1).reason


@_runs_bootstrapped()
async def test_attach_failure_fails_the_room_with_the_reason(b):
    sender, rx, coord, addr = b.sender, b.rx, b.coord, b.addr
    sender.create_room(1)
    sender.abort(1, "gone")
    rx.create_room(1, addr)
    assert not await coord.attach(1, addr, [1])
    r = rx.rooms.get(1)
    assert r.state == RoomState.FAILED and "room-finished" in r.reason


@_runs_bootstrapped()
async def test_success_roundtrip_over_fake_transport(b):
    """Sender writes the aux row into the receiver's pool as NIXL would, then notifies."""

    sender, rx, coord, addr = b.sender, b.rx, b.coord, b.addr
    sender.create_room(9)
    rx.create_room(9, addr)
    await coord.attach(9, addr, [0])
    sender.send(9, [0], 77, -2.0)
    slot = rx.rooms.get(9).aux_slot
    for i, w in enumerate(AuxRow(9, 77, -2.0, 500).words()):
        rx.pool.aux[slot, i] = w
    b.rx_agent.notifs["P"] = [KVNotification(9, 500, 10).encode()]
    rx.poll()
    assert rx.rooms.get(9).state == RoomState.SUCCESS and rx.result(9).token == 77


@_runs_bootstrapped()
async def test_room_dropped_during_attach_is_aborted_at_prefill(b):
    sender, rx, coord, addr = b.sender, b.rx, b.coord, b.addr
    await coord.ensure_registered(addr)
    sender.create_room(4)
    rx.create_room(4, addr)
    task = asyncio.ensure_future(coord.attach(4, addr, [1]))
    await asyncio.sleep(0)  # attach RPC in flight
    rx.fail(4, "client went away")
    assert not await task
    assert sender.rooms.get(4).state == RoomState.FAILED  # prefill told to drop it
