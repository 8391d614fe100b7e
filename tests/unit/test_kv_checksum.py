"""The KV checksum (services/transfer/kv_checksum.py): what it hashes, and the receiver failing a
room whose KV does not match (DATA_LOSS) before anything uses it. Fake NIXL, real page bytes."""

from __future__ import annotations

import pytest

from services.transfer.kv_checksum import NONE, kv_checksum, runs
from services.transfer.receiver import KVReceiver
from services.transfer.state import RoomState
from services.transfer.wire_format import AUX_CHECKSUM, AuxRow, KVNotification
from tests.unit.test_transfer_managers import Clock, FakeAgent, Pool

PAGE_BYTES = 32


class PagedPool(Pool):
    """A pool whose pages are real bytes (page_run_bytes, as KVPool's)."""

    def __init__(self, n=16):
        super().__init__(n)
        self.mem = bytearray(n * PAGE_BYTES)

    def page_run_bytes(self, first, count):
        return memoryview(self.mem)[first * PAGE_BYTES:(first + count) * PAGE_BYTES]

    def fill(self, page, seed):
        self.mem[page * PAGE_BYTES:(page + 1) * PAGE_BYTES] = bytes((seed * 7 + i) % 256 for i in range(PAGE_BYTES))


def test_runs_group_consecutive_pages():
    assert list(runs([3, 4, 5, 9, 10, 2])) == [(3, 3), (9, 2), (2, 1)]
    assert list(runs([])) == []


def test_the_checksum_sees_every_byte_the_order_and_the_words():
    pool = PagedPool()
    for p in range(8):
        pool.fill(p, p)
    base = kv_checksum(pool.page_run_bytes, [1, 2, 5], [7, 8, 9])
    assert base != NONE
    assert kv_checksum(pool.page_run_bytes, [1, 2, 5], [7, 8, 9]) == base
    assert kv_checksum(pool.page_run_bytes, [2, 1, 5], [7, 8, 9]) != base  # misplaced pages
    assert kv_checksum(pool.page_run_bytes, [1, 2, 5], [7, 8, 10]) != base  # a different first token
    pool.mem[2 * PAGE_BYTES + 17] ^= 0x01
    assert kv_checksum(pool.page_run_bytes, [1, 2, 5], [7, 8, 9]) != base  # one bit in flight


def receiver(verify=True, corrupt=0.0):
    agent = FakeAgent("D1", 10, 1_000_000, 2_000_000)
    done = []
    rx = KVReceiver(agent, PagedPool(), clock=Clock(), on_terminal=done.append, verify_checksum=verify,
                    corrupt_kv=corrupt)
    return rx, agent


def land(rx, agent, dst, src_bytes, *, checksum_over=None, checksum=None):
    """Attach room 1 to `dst`, write `src_bytes` pages into them (the WRITE), then the aux row
    with the checksum the sender computed over `checksum_over` (its source bytes)."""
    rx.create_room(1, "p:1")
    slot = rx.prepare_attach(1, dst).dst_aux_slot
    rx.mark_attached(1, "P", 500)
    sender_pool = PagedPool()
    for i, b in enumerate(checksum_over or src_bytes):
        sender_pool.mem[i * PAGE_BYTES:(i + 1) * PAGE_BYTES] = b
    for page, b in zip(dst, src_bytes, strict=True):
        rx.pool.mem[page * PAGE_BYTES:(page + 1) * PAGE_BYTES] = b
    words = AuxRow(1, 42, -0.5, 500, 0, sent_pages=len(src_bytes)).words()
    if checksum is None:
        checksum = kv_checksum(sender_pool.page_run_bytes, list(range(len(src_bytes))), words[:AUX_CHECKSUM])
    words[AUX_CHECKSUM] = checksum
    for i, w in enumerate(words):
        rx.pool.aux[slot, i] = w
    agent.notifs.setdefault("P", []).append(KVNotification(1, 500, 10).encode())
    rx.poll()
    return rx.rooms.get(1)


PAGES = [bytes([i]) * PAGE_BYTES for i in (1, 2, 3)]


def test_kv_that_matches_passes():
    rx, agent = receiver()
    r = land(rx, agent, [4, 5, 9], PAGES)
    assert r.state == RoomState.SUCCESS and rx.result(1).sent_pages == 3


@pytest.mark.parametrize("case", ["bytes", "order"])
def test_kv_that_differs_fails_the_room_with_data_loss(case):
    rx, agent = receiver()
    sent = [PAGES[0], PAGES[1][:-1] + b"\xff", PAGES[2]] if case == "bytes" else [PAGES[1], PAGES[0], PAGES[2]]
    r = land(rx, agent, [4, 5, 9], sent, checksum_over=PAGES)
    assert r.state == RoomState.FAILED and r.code == "DATA_LOSS" and "checksum" in r.reason
    assert rx.result(1) is None


def test_a_sender_without_the_checksum_and_a_receiver_not_checking_both_pass():
    rx, agent = receiver()
    assert land(rx, agent, [4, 5, 9], [PAGES[1], PAGES[0], PAGES[2]], checksum_over=PAGES,
                checksum=NONE).state == RoomState.SUCCESS
    rx, agent = receiver(verify=False)
    assert land(rx, agent, [4, 5, 9], [PAGES[1], PAGES[0], PAGES[2]],
                checksum_over=PAGES).state == RoomState.SUCCESS


def test_the_corrupt_kv_fault_is_caught_by_the_checksum():
    class Negatable(PagedPool):
        class _KV:
            def __init__(self, pool):
                self.pool = pool

            def __getitem__(self, page):
                pool = self.pool

                class _Page:
                    def neg_(self):
                        for i in range(page * PAGE_BYTES, (page + 1) * PAGE_BYTES):
                            pool.mem[i] ^= 0x80

                return _Page()

        def __init__(self):
            super().__init__()
            self.kv = self._KV(self)

    agent = FakeAgent("D1", 10, 1_000_000, 2_000_000)
    rx = KVReceiver(agent, Negatable(), clock=Clock(), verify_checksum=True, corrupt_kv=1.0)
    r = land(rx, agent, [4, 5], PAGES[:2])
    assert r.state == RoomState.FAILED and r.code == "DATA_LOSS"
