"""Deferred NIXL handles, quiesced rooms and the idle sweep (KVSender), and the coordinator's
progress bound (forward age in heartbeats) and prefill generations, against fakes."""

from __future__ import annotations

import asyncio

import pytest

from services.transfer.bootstrap import HeartbeatResult, KVReceiveCoordinator
from services.transfer.state import RoomState as S
from tests.unit.test_transfer_managers import make_sender, register

pytestmark = pytest.mark.timeout(10)


class Refusing:
    """Wraps the fake agent: release() refuses (returns False) while `refuse` is set."""

    def __init__(self, agent):
        self.agent, self.refuse = agent, True
        agent_release = agent.release

        def release(x):
            if self.refuse:
                x.release_error = "NIXL_ERR_IN_PROG"
                return False
            agent_release(x)
            return True

        agent.release = release


def test_a_deferred_handle_holds_the_room_until_a_sweep_releases_it():
    s, agent, clock, done = make_sender()
    ref = Refusing(agent)
    register(s)
    s.create_room(1)
    s.attach(1, "D1", 10, [0, 1], 0)
    s.send(1, [0, 1], 5, -1.0)
    assert not s.quiesced(1)  # WRITE in flight
    assert s.abort(1, "aborted by decode")
    assert s.rooms.get(1).state == S.FAILED
    # NIXL refused to cancel: decode must keep its pages, prefill its source pages
    assert not s.quiesced(1) and s.num_deferred_handles == 1
    freed = []
    assert not s.free_when_quiesced(1, lambda: freed.append(1))
    s.release(1)
    assert not s.quiesced(1)
    assert s.sweep() == {"expired_attaches": 0, "released_handles": 0, "deferred_rooms": 1} and not freed
    ref.refuse = False
    assert s.sweep()["released_handles"] == 1
    assert s.quiesced(1) and freed == [1] and s.num_deferred_handles == 0 and agent.num_live_handles == 0


def test_quiesced_for_unknown_failed_and_attached_rooms():
    s, agent, clock, done = make_sender()
    register(s)
    assert s.quiesced(99)  # never heard of: nothing references it
    s.create_room(2)
    s.attach(2, "D1", 10, [0], 0)
    assert not s.quiesced(2)  # attached: its forward may still post a WRITE
    s.abort(2, "x")
    assert s.quiesced(2)
    freed = []
    assert s.free_when_quiesced(2, lambda: freed.append(2)) and freed == [2]


def test_idle_sweep_drops_parked_attaches():
    s, agent, clock, done = make_sender(pending_attach_ttl=5)
    register(s)
    s.attach(3, "D1", 10, [1], 0)  # the Prefill RPC never comes
    clock.t = 4
    assert s.sweep()["expired_attaches"] == 0 and s.num_pending_attach == 1
    clock.t = 6
    assert s.sweep()["expired_attaches"] == 1 and s.num_pending_attach == 0


class FakeReceiver:
    agent_name, epoch = "dec", 1

    def __init__(self):
        self.failed: list[tuple[str, str]] = []
        self.calls: list[str] = []

    def waiting_by_peer(self):
        return {"p:1": [1, 2]}

    def apply_heartbeat(self, peer, asked, sender_epoch, held, forward_done):
        self.calls.append("held")
        return []

    def fail_waiting_for_input(self, peer, reason, sender_epoch=None):
        self.calls.append("forward")
        self.failed.append((peer, reason))
        return [1]

    def fail_peer(self, peer, reason):
        return []


class FakeClient:
    def __init__(self):
        self.replies = []

    async def heartbeat(self, *a, **kw):
        r = self.replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


def test_coordinator_fails_phase1_on_a_stuck_forward_and_tracks_generations():
    async def run():
        rec = FakeReceiver()
        coord = KVReceiveCoordinator(rec, "w", heartbeat_interval=0.01, heartbeat_max_failures=2, forward_timeout=5)
        client = FakeClient()
        coord.client = lambda addr: client
        client.replies = [HeartbeatResult(10, [1, 2], [], True, 4.0)]
        await coord.heartbeat_once()
        assert rec.failed == [] and coord.prefill_generation("p:1") == 0
        client.replies = [HeartbeatResult(10, [1, 2], [], True, 5.5)]
        await coord.heartbeat_once()
        assert rec.failed and "forward stuck" in rec.failed[0][1] and "--forward-timeout 5" in rec.failed[0][1]
        # the stuck forward is judged before the held list: prefill's own watchdog may have dropped
        # the forward's rooms already, and their reason is the forward, not "no longer holds"
        assert rec.calls[-2:] == ["forward", "held"]
        client.replies = [HeartbeatResult(11, [], [], True, 0.0)]  # restarted
        await coord.heartbeat_once()
        assert coord.prefill_generation("p:1") == 1
        client.replies = [RuntimeError("down"), RuntimeError("down")]
        await coord.heartbeat_once()
        await coord.heartbeat_once()
        assert coord.prefill_generation("p:1") == 2  # declared dead

    asyncio.run(run())


def test_quarantine_over_grpc_waits_for_quiesced_then_frees():
    """Real gRPC (in-process), fake NIXL: decode's Quarantine keeps the pages while prefill's
    Abort answers quiesced=false (a deferred handle), frees them once a sweep released it, and
    the forward age travels in the heartbeat reply."""
    import grpc as _grpc

    from services.decode.quarantine import Quarantine
    from services.transfer import bootstrap as bs
    from services.transfer.receiver import KVReceiver
    from tests.unit.test_quarantine import FakeAllocator
    from tests.unit.test_transfer_managers import FakeAgent, Pool

    async def run():
        s, agent, clock, done = make_sender()
        ref = Refusing(agent)
        server = _grpc.aio.server()
        bs.add_bootstrap_servicer(server, s, forward_age=lambda: 7.5)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        rx = KVReceiver(FakeAgent("D1", 10, 1_000_000, 2_000_000), Pool())
        coord = bs.KVReceiveCoordinator(rx, "decode-0", rpc_timeout=2, heartbeat_interval=0.05)
        alloc = FakeAllocator()
        q = Quarantine(coord, alloc, lambda: None, max_wait=30, retry=0.02)
        try:
            rx.create_room(1, addr)
            assert await coord.attach(1, addr, [3, 4])
            s.create_room(1)
            s.send(1, [0, 1], 9, -0.5)  # WRITE in flight
            hb = await coord.client(addr).heartbeat("D1", 10, [1])
            assert hb.forward_age == 7.5
            rx.fail(1, "client went away")
            q.hold(1, addr, [3, 4])
            await asyncio.sleep(0.2)
            assert q.pages_held() == 2 and not alloc.freed  # aborted, but NIXL still holds the handle
            ref.refuse = False
            s.sweep()
            for _ in range(100):
                if not q.held:
                    break
                await asyncio.sleep(0.01)
            assert alloc.freed == [([3, 4], 1)] and q.released == {"quiesced": 1}
        finally:
            await q.close()
            await coord.close()
            await server.stop(None)

    asyncio.run(run())
