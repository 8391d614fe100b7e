"""Prefill's READ of decode's held prefix (services/transfer/reader.py, and its place in KVSender)
against a fake NIXL agent that moves real bytes between two byte arrays: a verified READ, a
checksum mismatch, a NIXL error, the deadline (also for a READ never checked: stall_kv_read), a
handle NIXL will not release (no outcome until it does; a room that ends meanwhile keeps its
pages through the sender's deferred handles), and the Attach's validation of held pages. Pure
Python, runs in milliseconds; tests/integration/test_prefix_cache_mesh.py runs the real thing."""

from __future__ import annotations

import pytest

from services.transfer.reader import CHECKSUM, ERROR, TIMEOUT, KVReader, page_checksum
from services.transfer.sender import BootstrapRejected
from services.transfer.state import RoomState
from services.transfer.wire_format import MemoryKind, MemoryLayout, NixlError
from tests.unit.test_transfer_managers import PAGE, Clock, FakeAgent, Pool, make_sender

N = 16  # pages on each side
LOCAL = MemoryLayout(0, PAGE, N, MemoryKind.DRAM, 0, 100_000, 32, 8)
REMOTE = MemoryLayout(1_000_000, PAGE, N, MemoryKind.DRAM, 0, 2_000_000, 32, 8)


class Read:
    def __init__(self, descs):
        self.descs, self.state, self.released = descs, "PROC", False


class Memory:
    """Both sides' KV bytes: local at address 0, the peer's at REMOTE.kv_base_addr."""

    def __init__(self):
        self.local = bytearray(N * PAGE)
        self.remote = bytearray((i * 37 + 11) % 251 for i in range(N * PAGE))

    def page_run_bytes(self, first, count):
        return bytes(self.local[first * PAGE : (first + count) * PAGE])

    def land(self, x: Read):
        """The READ's bytes arrive: each desc's dst (the peer's) into its src (ours)."""
        for d in x.descs:
            r = d.dst_addr - REMOTE.kv_base_addr
            self.local[d.src_addr : d.src_addr + d.nbytes] = self.remote[r : r + d.nbytes]


class ReadAgent(FakeAgent):
    """FakeAgent plus post_read; `post` says what posting does (PROC, DONE, raise), `refuse`
    makes release() refuse while set."""

    def __init__(self, mem, *a, **kw):
        super().__init__(*a, **kw)
        self.mem, self.post, self.refuse, self.reads = mem, "PROC", False, []

    def post_read(self, peer, descs, kind, ldev, rdev):
        if self.post == "raise":
            raise NixlError("cannot reach peer")
        x = Read(descs)
        self.reads.append(x)
        self.live.add(x)
        if self.post == "DONE":
            self.mem.land(x)
            x.state = "DONE"
        return x, x.state

    def check(self, x):
        if x.state == "ERR":
            raise NixlError("remote gone")
        return x.state

    def release(self, x):
        if self.refuse:
            return False
        x.released = True
        self.live.discard(x)
        return True


def remote_checksums(mem, pages):
    saved, mem.local = mem.local, mem.remote  # hash the peer's bytes as decode would
    try:
        return [page_checksum(mem.page_run_bytes, p) for p in pages]
    finally:
        mem.local = saved


def reader(timeout=2.0, stall=False):
    mem, clock = Memory(), Clock()
    agent = ReadAgent(mem, "P", 500, 0, 100_000)
    agent.add_peer(b"D1")
    return KVReader(agent, mem, clock=clock, timeout=timeout, stall=stall), agent, mem, clock


def start(rd, mem, local=(4, 5, 6), remote=(9, 10, 2), checksums=None):
    ends = []
    sums = remote_checksums(mem, remote) if checksums is None else checksums
    out = rd.start(1, "D1", REMOTE, LOCAL, list(local), list(remote), sums, ends.append)
    return out, ends


def test_a_verified_read_brings_the_peers_pages_into_ours():
    rd, agent, mem, clock = reader()
    out, ends = start(rd, mem)
    assert out is None and rd.poll() == 1 and not ends  # in progress
    assert [(d.src_addr // PAGE, d.dst_addr // PAGE - REMOTE.kv_base_addr // PAGE, d.nbytes // PAGE)
            for d in agent.reads[0].descs] == [(4, 9, 2), (6, 2, 1)]  # runs contiguous on both sides
    mem.land(agent.reads[0])
    agent.reads[0].state = "DONE"
    clock.t = 0.25
    assert rd.poll() == 0
    (o,) = ends
    assert o.ok and o.pages == 3 and o.nbytes == 3 * PAGE and o.seconds == 0.25
    assert mem.local[4 * PAGE : 6 * PAGE] == mem.remote[9 * PAGE : 11 * PAGE]
    assert agent.reads[0].released and 1 not in rd


def test_a_read_done_at_once_ends_at_once_and_without_checksums_nothing_is_verified():
    rd, agent, mem, clock = reader()
    agent.post = "DONE"
    out, ends = start(rd, mem)
    assert out.ok and not ends and len(rd) == 0
    out, _ = start(rd, mem, checksums=[])
    assert out.ok  # decode computed none (its --kv-checksum off): the operator chose


def test_bytes_that_differ_from_decodes_checksum_give_nothing():
    rd, agent, mem, clock = reader()
    sums = remote_checksums(mem, [9, 10, 2])
    sums[1] ^= 1
    out, ends = start(rd, mem, checksums=sums)
    mem.land(agent.reads[0])
    agent.reads[0].state = "DONE"
    rd.poll()
    assert not ends[0].ok and ends[0].reason == CHECKSUM and "page 1 of 3" in ends[0].detail


def test_a_nixl_error_posting_or_in_flight_gives_nothing():
    rd, agent, mem, clock = reader()
    agent.post = "raise"
    out, ends = start(rd, mem)
    assert not out.ok and out.reason == ERROR and "cannot reach" in out.detail and len(rd) == 0
    agent.post = "PROC"
    out, ends = start(rd, mem)
    agent.reads[0].state = "ERR"
    assert rd.poll() == 0 and ends[0].reason == ERROR and agent.reads[0].released


@pytest.mark.parametrize("stall", [False, True])
def test_a_read_that_never_answers_ends_at_its_deadline(stall):
    rd, agent, mem, clock = reader(timeout=2.0, stall=stall)
    out, ends = start(rd, mem)
    if stall:  # the fault: even a READ that is DONE is not looked at
        mem.land(agent.reads[0])
        agent.reads[0].state = "DONE"
    clock.t = 1.9
    assert rd.poll() == 1 and not ends
    clock.t = 2.0
    assert rd.poll() == 0 and ends[0].reason == TIMEOUT and "2s" in ends[0].detail
    assert agent.reads[0].released


def test_no_outcome_until_nixl_lets_go_of_the_handle():
    rd, agent, mem, clock = reader(timeout=1.0)
    out, ends = start(rd, mem)
    agent.refuse = True
    clock.t = 5.0
    assert rd.poll() == 1 and not ends  # it may still write into our pages: the job must not compute
    agent.refuse = False
    assert rd.poll() == 0 and ends[0].reason == TIMEOUT


def test_cancel_releases_or_hands_back_a_handle_nixl_keeps():
    rd, agent, mem, clock = reader()
    out, ends = start(rd, mem)
    assert rd.cancel(1) is None and agent.reads[0].released and 1 not in rd
    out, ends = start(rd, mem)
    agent.refuse = True
    assert rd.cancel(1) is agent.reads[1] and not ends and rd.poll() == 0
    assert rd.cancel(1) is None  # nothing left


def test_bad_reads_are_refused():
    rd, agent, mem, clock = reader()
    with pytest.raises(ValueError):
        start(rd, mem, local=(1, 2), remote=(3,))
    with pytest.raises(ValueError):
        start(rd, mem, checksums=[1])
    start(rd, mem)
    with pytest.raises(ValueError):
        start(rd, mem)  # one READ per room


# --- in KVSender ---------------------------------------------------------------------------


def read_sender(**kw):
    s, _, clock, done = make_sender(**kw)
    mem = Memory()
    agent = ReadAgent(mem, "P", 500, 0, 100_000)
    s.agent = s.reader.agent = agent
    s.pool = s.reader.pool = Pool()
    s.reader.pool = mem
    s.register_peer("D", "D1", 10, b"D1", REMOTE)
    return s, agent, mem, clock, done


def test_attach_validates_the_held_pages():
    s, agent, mem, clock, done = read_sender()
    for held, sums in (([1, 2], []), ([1, 1, 2], []), ([1, 2, 99], []), ([1, 2, 5], []), ([1, 2, 3], [7])):
        with pytest.raises(BootstrapRejected) as e:
            s.attach(7, "D1", 10, [5, 6], 0, 3, held, sums)  # skip 3: three held pages, not in dst
        assert e.value.kind == "bad-request"
    s.create_room(7)
    s.attach(7, "D1", 10, [5, 6], 0, 3, [1, 2, 3], [11, 12, 13])
    a = s.rooms.get(7).attach
    assert a.held_pages == (1, 2, 3) and a.held_checksums == (11, 12, 13)


def test_the_sender_reads_a_slice_of_the_offer_and_polls_it():
    s, agent, mem, clock, done = read_sender()
    s.create_room(7)
    held = [8, 9, 10, 11]
    s.attach(7, "D1", 10, [5, 6], 0, 4, held, remote_checksums(mem, held))
    ends = []
    assert s.start_read(7, [2, 3], 2, ends.append) is None  # held pages 2, 3: decode's 10, 11
    mem.land(agent.reads[0])
    agent.reads[0].state = "DONE"
    s.poll()
    assert ends[0].ok and mem.local[2 * PAGE : 4 * PAGE] == mem.remote[10 * PAGE : 12 * PAGE]
    with pytest.raises(ValueError):
        s.start_read(7, [2, 3], 3, ends.append)  # beyond the offer


def test_a_room_that_ends_during_its_read_keeps_its_pages_until_nixl_lets_go():
    s, agent, mem, clock, done = read_sender()
    s.create_room(7)
    s.attach(7, "D1", 10, [5, 6], 0, 2, [8, 9], [])
    ends = []
    s.start_read(7, [0, 1], 0, ends.append)
    agent.refuse = True
    s.abort(7, "aborted by decode")  # decode's room ended: its quarantine asks for quiesced
    assert s.rooms.get(7).state == RoomState.FAILED and not ends
    freed = []
    assert not s.quiesced(7) and not s.free_when_quiesced(7, lambda: freed.append(7))
    s.sweep()
    assert not freed and s.num_deferred_handles == 1
    agent.refuse = False
    s.sweep()
    assert freed == [7] and s.quiesced(7) and not agent.live and not ends


# --- decode's offer ------------------------------------------------------------------------


@pytest.mark.parametrize("verify,corrupt", [(True, False), (True, True), (False, False)])
def test_decode_offers_its_held_pages_with_a_checksum_each(verify, corrupt):
    from services.transfer.receiver import KVReceiver

    mem, pool = Memory(), Pool()
    mem.local = mem.remote  # decode's own pages
    pool.page_run_bytes = mem.page_run_bytes
    rx = KVReceiver(FakeAgent("D1", 10, 0, 100_000), pool, verify_checksum=verify, corrupt_kv_read=corrupt)
    rx.create_room(3, "prefill:1")
    params = rx.prepare_attach(3, [7, 8], 3, [4, 5, 6])
    assert params.held_pages == [4, 5, 6] and params.skip_pages == 3
    sums = [page_checksum(mem.page_run_bytes, p) for p in (4, 5, 6)]
    if not verify:
        assert params.held_checksums == []  # --kv-checksum off: prefill verifies nothing
    elif corrupt:  # the fault: the last page's (a READ always takes it) is wrong
        assert params.held_checksums[:2] == sums[:2] and params.held_checksums[2] != sums[2]
    else:
        assert params.held_checksums == sums
