"""KVSender / KVReceiver logic against a fake NIXL agent (the real one is exercised by
tests/integration/test_kv_transfer.py). Pure Python, runs in milliseconds."""

from __future__ import annotations

import pytest

from services.engine.page_allocator import PageAllocator
from services.transfer.receiver import KVReceiver
from services.transfer.sender import BootstrapRejected, KVSender
from services.transfer.state import DuplicateRoom, RoomState
from services.transfer.wire_format import (
    AUX_WORDS,
    AbortNotification,
    AuxRow,
    KVNotification,
    MemoryKind,
    MemoryLayout,
    NixlError,
)

S = RoomState
PAGE = 64


class Aux:
    """Stands in for the int64 [slots, AUX_WORDS] tensor (item get/set and row.tolist())."""

    def __init__(self, n):
        self.rows = [[0] * AUX_WORDS for _ in range(n)]

    def __setitem__(self, key, v):
        slot, i = key
        self.rows[slot][i] = v

    def __getitem__(self, slot):
        row = self.rows[slot]

        class _R:
            def tolist(self):
                return list(row)

        return _R()


class Pool:
    def __init__(self, n=8):
        self.aux = Aux(n)
        self.aux_allocator = PageAllocator(n)


class Xfer:
    def __init__(self, peer, descs, notif):
        self.peer, self.descs, self.notif = peer, descs, notif
        self.state = "PROC"


class FakeAgent:
    def __init__(self, name, epoch, kv_base, aux_base, kind=MemoryKind.DRAM):
        self.name, self.epoch = name, epoch
        self.layout = MemoryLayout(kv_base, PAGE, 100, kind, 0, aux_base, 32, 8)
        self.peers: set[str] = set()
        self.posted: list[Xfer] = []
        self.live: set[Xfer] = set()
        self.notifs: dict[str, list[bytes]] = {}
        self.removed: list[str] = []
        self.sent: list[tuple[str, bytes]] = []  # standalone notifications

    def metadata(self):
        return self.name.encode()

    def add_peer(self, md):
        self.peers.add(md.decode())
        return md.decode()

    def remove_peer(self, name):
        self.peers.discard(name)
        self.removed.append(name)

    def post_write(self, peer, descs, kind, ldev, rdev, notif=b""):
        if peer not in self.peers:
            raise NixlError(f"{peer} not loaded")
        x = Xfer(peer, descs, notif)
        self.posted.append(x)
        self.live.add(x)
        return x, "PROC"

    def check(self, x):
        if x.state == "ERR":
            raise NixlError("remote gone", disconnected=True)
        return x.state

    def release(self, x):
        self.live.discard(x)

    def retry_releases(self):
        pass

    def progress(self):
        pass

    def send_notif(self, peer, msg):
        self.sent.append((peer, msg))
        return peer in self.peers

    @property
    def num_live_handles(self):
        return len(self.live)

    def get_notifs(self):
        n, self.notifs = self.notifs, {}
        return n


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def make_sender(**kw):
    clock = Clock()
    agent = FakeAgent("P", 500, kv_base=0, aux_base=100_000)
    done = []
    s = KVSender(agent, Pool(), clock=clock, on_terminal=done.append, **kw)
    return s, agent, clock, done


DEC_LAYOUT = MemoryLayout(1_000_000, PAGE, 100, MemoryKind.DRAM, 0, 2_000_000, 32, 8)


def register(s, worker="D", name="D1", epoch=10):
    s.register_peer(worker, name, epoch, name.encode(), DEC_LAYOUT)


def make_sender_with_room_1_sent(**kw):
    """make_sender(), with peer D1 registered and room 1 attached to it and sent."""
    s, agent, clock, done = make_sender(**kw)
    register(s)
    s.create_room(1)
    s.attach(1, "D1", 10, [0], 0)
    s.send(1, [0], 5, -1.0)
    return s, agent, clock, done


def test_happy_path_sender():
    s, agent, clock, done = make_sender()
    register(s)
    r = s.create_room(7)
    assert r.state == S.BOOTSTRAPPING
    clock.t = 1
    s.attach(7, "D1", 10, [4, 5, 6], 3)
    assert r.state == S.WAITING_FOR_INPUT and r.state_since == 1
    clock.t = 2
    assert s.send(7, [0, 1, 2], first_token=9, logprob=-0.5)
    assert r.state == S.TRANSFERRING and r.state_since == 2
    x = agent.posted[0]
    # one KV run (pages 0-2 -> 4-6) + the aux row, one WRITE, notification tagged room+epochs
    assert [(d.src_addr, d.dst_addr, d.nbytes) for d in x.descs] == [
        (0, 1_000_000 + 4 * PAGE, 3 * PAGE),
        (100_000 + 32 * r.aux_slot, 2_000_000 + 3 * 32, 32),
    ]
    assert KVNotification.decode(x.notif) == KVNotification(7, 500, 10)
    assert AuxRow.from_words(s.pool.aux[r.aux_slot].tolist()) == AuxRow(7, 9, -0.5, 500, sent_pages=3)
    assert s.poll() == 1
    x.state = "DONE"
    assert s.poll() == 0
    assert r.state == S.SUCCESS and done == [r] and agent.num_live_handles == 0
    assert s.pool.aux_allocator.is_whole()
    s.release(7)
    assert s.heartbeat("D1", 10, [7]) == ([7], [7], True)  # success tombstone still "held"


def test_pages_decode_holds_are_not_sent():
    s, agent, _, done = make_sender()
    register(s)
    r = s.create_room(7)
    s.attach(7, "D1", 10, [8, 9], 3, skip_pages=2)  # decode holds the prompt's first two pages
    assert s.send(7, [0, 1, 2, 3], first_token=9, logprob=-0.5, cached_tokens=32)
    x = agent.posted[0]
    assert [(d.src_addr, d.dst_addr, d.nbytes) for d in x.descs][0] == (2 * PAGE, 1_000_000 + 8 * PAGE, 2 * PAGE)
    assert r.nbytes == 2 * PAGE + 32
    assert AuxRow.from_words(s.pool.aux[r.aux_slot].tolist()).cached_tokens == 32
    r2 = s.create_room(8)
    s.attach(8, "D1", 10, [10], 4, skip_pages=3)
    s.send(8, [0, 1, 2], first_token=9, logprob=-0.5)  # decode claims every page: refused
    assert r2.state == S.FAILED and "nothing left to send" in r2.reason
    with pytest.raises(BootstrapRejected, match="skip_pages"):
        s.attach(9, "D1", 10, [1], 0, skip_pages=101)


def test_attach_before_create_is_parked_then_claimed():
    s, agent, clock, done = make_sender()
    register(s)
    s.attach(3, "D1", 10, [1], 0)
    assert s.num_pending_attach == 1 and 3 not in s.rooms
    assert s.heartbeat("D1", 10, [3]) == ([3], [], True)
    r = s.create_room(3)
    assert r.state == S.WAITING_FOR_INPUT and s.num_pending_attach == 0


def test_parked_attach_expires():
    s, agent, clock, done = make_sender(pending_attach_ttl=5)
    register(s)
    s.attach(3, "D1", 10, [1], 0)
    clock.t = 6
    s.poll()
    assert s.num_pending_attach == 0


def test_attach_rejections():
    s, agent, clock, done = make_sender()
    with pytest.raises(BootstrapRejected) as e:
        s.attach(1, "D1", 10, [1], 0)
    assert e.value.kind == "peer-not-registered" and e.value.code == "FAILED_PRECONDITION"
    register(s)
    with pytest.raises(BootstrapRejected, match="epoch"):
        s.attach(1, "D1", 11, [1], 0)
    for pages, slot in (([], 0), ([100], 0), ([1, 1], 0), ([1], 8)):
        with pytest.raises(BootstrapRejected) as e:
            s.attach(1, "D1", 10, pages, slot)
        assert e.value.kind == "bad-request"
    s.create_room(1)
    s.attach(1, "D1", 10, [1], 0)
    with pytest.raises(BootstrapRejected) as e:
        s.attach(1, "D1", 10, [2], 1)
    assert e.value.kind == "room-duplicate"


def test_attach_to_finished_room_is_refused_and_never_recreates():
    s, agent, clock, done = make_sender()
    register(s)
    s.create_room(1)
    s.abort(1, "client went away")
    s.release(1)
    with pytest.raises(BootstrapRejected) as e:
        s.attach(1, "D1", 10, [1], 0)
    assert e.value.kind == "room-finished"
    assert 1 not in s.rooms and s.num_pending_attach == 0
    with pytest.raises(DuplicateRoom):
        s.create_room(1)


def test_abort_before_anything_blocks_later_attach():
    s, agent, clock, done = make_sender()
    register(s)
    s.abort(5, "router cancelled")
    with pytest.raises(BootstrapRejected, match="finished"):
        s.attach(5, "D1", 10, [1], 0)


def test_late_send_after_failure_is_dropped():
    s, agent, clock, done = make_sender()
    register(s)
    s.create_room(1)
    s.attach(1, "D1", 10, [1], 0)
    s.fail(1, "watchdog")
    assert not s.send(1, [0], 1, 0.0)
    assert agent.posted == [] and s.rooms.get(1).state == S.FAILED


def test_send_before_attach_is_a_scheduler_bug():
    s, agent, clock, done = make_sender()
    s.create_room(1)
    with pytest.raises(ValueError):
        s.send(1, [0], 1, 0.0)


def test_disconnect_fails_only_that_peers_rooms():
    s, agent, clock, done = make_sender()
    register(s, "A", "A1", 10)
    register(s, "B", "B1", 10)
    for room, peer in ((1, "A1"), (2, "A1"), (3, "B1")):
        s.create_room(room)
        s.attach(room, peer, 10, [room], room)
    s.send(1, [0], 1, 0.0)
    s.send(3, [1], 1, 0.0)
    agent.posted[0].state = "ERR"
    s.poll()
    st = {r: s.rooms.get(r).state for r in (1, 2, 3)}
    assert st == {1: S.FAILED, 2: S.FAILED, 3: S.TRANSFERRING}
    assert "disconnected" in s.rooms.get(2).reason or "NIXL" in s.rooms.get(2).reason
    assert "A1" in agent.removed and "B1" in agent.peers
    # A re-registers (same agent, e.g. transient) and works again
    register(s, "A", "A1", 10)
    s.create_room(4)
    s.attach(4, "A1", 10, [4], 4)
    assert s.rooms.get(4).state == S.WAITING_FOR_INPUT


def test_new_epoch_replaces_old_agent_and_fails_its_rooms():
    s, agent, clock, done = make_sender()
    register(s, "D", "D-old", 10)
    s.create_room(1)
    s.attach(1, "D-old", 10, [1], 0)
    register(s, "D", "D-new", 11)
    assert s.rooms.get(1).state == S.FAILED and "restarted" in s.rooms.get(1).reason
    assert agent.removed == ["D-old"] and agent.peers == {"D-new"}
    assert s.stats["peers_replaced"] == 1
    with pytest.raises(BootstrapRejected, match="older"):
        register(s, "D", "D-older", 9)
    register(s, "D", "D-new", 11)  # idempotent
    assert agent.removed == ["D-old"]


def test_layout_mismatch_refused():
    s, agent, clock, done = make_sender()
    bad = MemoryLayout(0, PAGE * 2, 100, MemoryKind.DRAM, 0, 0, 32, 8)
    with pytest.raises(BootstrapRejected) as e:
        s.register_peer("D", "D1", 1, b"D1", bad)
    assert e.value.kind == "layout-mismatch"


def test_vram_kv_goes_in_two_stages_aux_last():
    s, agent, clock, done = make_sender()
    agent.layout = MemoryLayout(0, PAGE, 100, MemoryKind.VRAM, 0, 100_000, 32, 8)
    register(s)
    s.create_room(1)
    s.attach(1, "D1", 10, [0, 1], 0)
    s.send(1, [0, 1], 5, -1.0)
    first = agent.posted[0]
    assert first.notif == b"" and len(first.descs) == 1
    first.state = "DONE"
    s.poll()
    second = agent.posted[1]
    assert second.notif and second.descs[0].nbytes == 32
    assert s.rooms.get(1).state == S.TRANSFERRING
    second.state = "DONE"
    s.poll()
    assert s.rooms.get(1).state == S.SUCCESS and agent.num_live_handles == 0


def test_stall_before_post_knob():
    s, agent, clock, done = make_sender_with_room_1_sent(stall_before_post=2.0)
    assert agent.posted == [] and s.poll() == 1
    clock.t = 2.5
    s.poll()
    assert len(agent.posted) == 1


def test_watchdog_failure_releases_handle_and_aux_slot():
    s, agent, clock, done = make_sender_with_room_1_sent()
    assert agent.num_live_handles == 1
    clock.t = 61
    assert [e.room for e in s.rooms.expired({S.TRANSFERRING: 60})] == [1]
    s.fail(1, "inflight_timeout")
    assert agent.num_live_handles == 0 and s.pool.aux_allocator.is_whole()
    assert not s.fail(1, "again")
    # decode is told at once (best-effort), exactly once
    [(peer, msg)] = agent.sent
    assert peer == "D1" and AbortNotification.decode(msg) == AbortNotification(1, s.epoch, "inflight_timeout")


def test_no_abort_notification_to_a_peer_that_is_gone():
    s, agent, clock, done = make_sender_with_room_1_sent()
    agent.posted[-1].state = "ERR"  # disconnect
    s.poll()
    assert s.rooms.get(1).state == S.FAILED and agent.sent == []


# --- receiver ------------------------------------------------------------------------------


def make_receiver():
    clock = Clock()
    agent = FakeAgent("D1", 10, 1_000_000, 2_000_000)
    done = []
    return KVReceiver(agent, Pool(), clock=clock, on_terminal=done.append), agent, clock, done


def deliver(rx, agent, room, sender="P", s_epoch=500, r_epoch=10, row=None):
    r = rx.rooms.get(room)
    if row is not None:
        for i, w in enumerate(row.words()):
            rx.pool.aux[r.aux_slot, i] = w
    agent.notifs.setdefault(sender, []).append(KVNotification(room, s_epoch, r_epoch).encode())


def test_receiver_happy_path_and_phases():
    rx, agent, clock, done = make_receiver()
    r = rx.create_room(1, "p:1")
    p = rx.prepare_attach(1, [4, 5])
    assert (p.agent_name, p.epoch, p.dst_pages) == ("D1", 10, [4, 5])
    clock.t = 1
    rx.mark_attached(1, "P", 500)
    assert r.state == S.WAITING_FOR_INPUT and rx.waiting_by_peer() == {"p:1": [1]}
    clock.t = 2
    assert rx.apply_heartbeat("p:1", [1], 500, held=[1], forward_done=[1]) == []
    assert r.state == S.TRANSFERRING and r.state_since == 2
    deliver(rx, agent, 1, row=AuxRow(1, 42, -0.125, 500))
    assert rx.poll() == 0
    assert r.state == S.SUCCESS and rx.result(1) == AuxRow(1, 42, -0.125, 500) and done == [r]
    rx.release(1)
    assert rx.pool.aux_allocator.is_whole()


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"row": AuxRow(2, 42, 0.0, 500)}, "room 2, expected 1"),
        ({"row": AuxRow(1, 42, 0.0, 499)}, "epoch 499"),
        ({"row": None}, "room 0"),  # slot cleared at attach: nothing written
        ({"row": AuxRow(1, 42, 0.0, 500), "sender": "X"}, "from X"),
        ({"row": AuxRow(1, 42, 0.0, 500), "r_epoch": 9}, "epochs"),
    ],
)
def test_receiver_never_accepts_wrong_kv(kw, why):
    rx, agent, clock, done = make_receiver()
    rx.create_room(1, "p:1")
    slot = rx.prepare_attach(1, [4]).dst_aux_slot
    rx.pool.aux[slot, 0] = 0
    rx.mark_attached(1, "P", 500)
    deliver(rx, agent, 1, **kw)
    rx.poll()
    r = rx.rooms.get(1)
    assert r.state == S.FAILED and why in r.reason and rx.result(1) is None


def test_abort_notification_fails_the_room_only_from_its_prefill():
    rx, agent, clock, done = make_receiver()
    r = rx.create_room(1, "p:1")
    rx.prepare_attach(1, [4])
    rx.mark_attached(1, "P", 500)
    agent.notifs["X"] = [AbortNotification(1, 500, "not yours").encode()]  # another agent
    agent.notifs["P"] = [AbortNotification(1, 499, "old generation").encode()]  # stale epoch
    rx.poll()
    assert r.state == S.WAITING_FOR_INPUT and rx.stats["dropped_notifs"] == 2
    agent.notifs["P"] = [AbortNotification(1, 500, "watchdog: inflight").encode()]
    rx.poll()
    assert r.state == S.FAILED and "watchdog: inflight" in r.reason and done == [r]
    rx.release(1)
    assert rx.pool.aux_allocator.is_whole()


def test_notification_before_attach_reply_is_kept():
    rx, agent, clock, done = make_receiver()
    rx.create_room(1, "p:1")
    rx.prepare_attach(1, [4])
    deliver(rx, agent, 1, row=AuxRow(1, 3, 0.0, 500))
    assert rx.poll() == 1  # still waiting for the attach reply
    assert rx.rooms.get(1).state == S.BOOTSTRAPPING
    rx.mark_attached(1, "P", 500)
    assert rx.rooms.get(1).state == S.SUCCESS


def test_late_notification_for_released_room_is_dropped():
    rx, agent, clock, done = make_receiver()
    rx.create_room(1, "p:1")
    rx.prepare_attach(1, [4])
    rx.mark_attached(1, "P", 500)
    rx.fail(1, "transfer_timeout")
    rx.release(1)
    agent.notifs["P"] = [KVNotification(1, 500, 10).encode(), b"not ours"]
    rx.poll()
    assert 1 not in rx.rooms and rx.stats["dropped_notifs"] == 1 and rx.stats["foreign_notifs"] == 1


def test_heartbeat_fails_rooms_not_held_or_from_a_restarted_prefill():
    rx, agent, clock, done = make_receiver()
    for room in (1, 2, 3):
        rx.create_room(room, "p:1")
        rx.prepare_attach(room, [room])
        rx.mark_attached(room, "P", 500)
    failed = rx.apply_heartbeat("p:1", [1, 2], 500, held=[1], forward_done=[])
    assert failed == [2] and rx.rooms.get(1).state == S.WAITING_FOR_INPUT
    failed = rx.apply_heartbeat("p:1", [1, 3], 501, held=[1, 3], forward_done=[])
    assert failed == [1, 3] and "restarted" in rx.rooms.get(1).reason


def test_a_stuck_forward_fails_only_the_waiting_rooms_of_that_prefill_generation():
    rx, agent, clock, done = make_receiver()
    for room, epoch in ((1, 500), (2, 501)):
        rx.create_room(room, "p:1")
        rx.prepare_attach(room, [room])
        rx.mark_attached(room, "P", epoch)
    assert rx.fail_waiting_for_input("p:1", "forward stuck", sender_epoch=501) == [2]
    assert rx.rooms.get(1).state == S.WAITING_FOR_INPUT  # an earlier generation's room: "restarted" is its reason
    assert rx.fail_waiting_for_input("p:1", "forward stuck") == [1]


def test_fail_peer_fails_only_that_peer():
    rx, agent, clock, done = make_receiver()
    rx.create_room(1, "p:1")
    rx.create_room(2, "p:2")
    assert rx.fail_peer("p:1", "unreachable") == [1]
    assert rx.rooms.get(2).state == S.BOOTSTRAPPING
