"""Decode with the prefix cache, on the random built-in model with a fake prefill side: a
finished request's full pages stay cached, the next round attaches naming only its fresh pages
(skip_pages) and offers the held ones for prefill's READ, a request that ends before its KV
arrived quarantines the pages prefill may still touch (the fresh ones it was named, and the held
ones it was offered; only the fresh ones when nothing is offered), a
colocated request computes from the end of its hit, and after everything ends every page is
free or cached with no holder."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.decode.jobs import Phase
from services.decode.worker import DecodeWorker
from services.transfer.receiver import KVReceiver
from services.transfer.state import RoomState
from services.transfer.wire_format import AuxRow
from tests.unit.prefix_cache_engine import empty_cache_then_whole_pool, random_engine_with_prefix_cache
from tests.unit.test_transfer_managers import FakeAgent

P = 16
PROMPT = [40 + (i * 7) % 80 for i in range(40)]
NEXT = PROMPT + [1, 2, 3] + [30 + (i * 5) % 60 for i in range(27)]  # 70 tokens
PREFILL = "prefill:1"


class FakeCoordinator:
    """The attach records what decode named; prefill answers every quarantine Abort 'quiesced'."""

    heartbeat_max_failures, rpc_timeout, heartbeat_interval = 3, 1.0, 1.0

    def __init__(self, receiver):
        self.receiver = receiver
        self.attached: dict[int, tuple[list[int], int]] = {}
        self.offered: dict[int, list[int]] = {}
        self.aborted: list[int] = []

    async def attach(self, room, address, dst_pages, skip_pages=0, held_pages=()):
        self.attached[room] = (list(dst_pages), skip_pages)
        self.offered[room] = list(held_pages)
        return True

    def prefill_generation(self, address):
        return 1

    def client(self, address):
        async def abort(room, reason, agent, timeout=None):
            self.aborted.append(room)
            return SimpleNamespace(quiesced=True)

        return SimpleNamespace(abort=abort)


@pytest.fixture(scope="module")
def engine():
    return random_engine_with_prefix_cache(32, P)


@pytest.fixture
def worker(engine):
    with empty_cache_then_whole_pool(engine):
        receiver = KVReceiver(FakeAgent("D1", 10, 0, 100_000), engine.pool)
        yield DecodeWorker(engine, receiver, FakeCoordinator(receiver), Metrics("decode", "m", "w"), Faults(), 8,
                           quarantine_retry=0.01)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


async def admitted(w, room, ids, prefill=PREFILL, params=GREEDY):
    job = w.submit(room, list(ids), params, prefill)
    w.admission.admit()
    for _ in range(5):
        await asyncio.sleep(0)  # the attach task runs
    return job


def arrive(w, job, cached_tokens=0):
    """Prefill's KV and first token land (the receiver's success, as the poller reports it)."""
    w._on_kv(job.room, RoomState.SUCCESS, None, AuxRow(job.room, 5, -0.5, 500, cached_tokens))


async def first_round_cached(w):
    """Room 1 (PROMPT) gets its KV and ends: its two full pages stay cached."""
    first = await admitted(w, 1, PROMPT)
    arrive(w, first)
    w.abort(1, "done")


async def quarantine_emptied(w):
    for _ in range(100):
        if not w.admission.has_quarantine:
            break
        await asyncio.sleep(0.01)


def test_a_finished_round_stays_cached_and_the_next_attaches_for_the_delta_only(worker, engine):
    async def go():
        first = await admitted(worker, 1, PROMPT)
        assert worker.coordinator.attached[1] == (first.pages[:3], 0)
        arrive(worker, first)
        worker.emit(first, 6, -0.1)  # a second token: the step that fed token 5 wrote its KV
        first_pages = list(first.pages)
        worker.abort(1, "client done")  # ends RUNNING: prompt + [5] has KV, 2 full pages
        await asyncio.sleep(0)
        assert engine.prefix_cache.num_pages == 2 and engine.pool.allocator.num_idle == 2
        second = await admitted(worker, 2, NEXT)
        dst, skip = worker.coordinator.attached[2]
        assert skip == 2 and second.cached_tokens == 32
        assert second.pages[:2] == first_pages[:2] and dst == second.pages[2:5]
        assert all(not engine.pool.allocator.is_cached(p) for p in dst)  # only fresh pages are named
        assert worker.coordinator.offered[2] == first_pages[:2]  # the held prefix, offered for a READ
        arrive(worker, second, cached_tokens=32)
        assert second.usage_cached_tokens == 32 and second.phase is Phase.RUNNING
        worker.abort(2, "client done")
        await asyncio.sleep(0)
        assert engine.prefix_cache.num_pages == 4  # NEXT's four full pages
        assert counter(worker, "prefix_cache_hits") == 32 and counter(worker, "prefix_cache_queries") == 110

    asyncio.run(go())


@pytest.mark.parametrize("offer", [True, False])
def test_a_room_that_ends_awaiting_its_kv_quarantines_what_prefill_may_touch(worker, engine, offer):
    worker.offer_held_prefix = offer

    async def go():
        await first_round_cached(worker)
        shared = list(engine.prefix_cache.match(NEXT))
        second = await admitted(worker, 2, NEXT)
        assert second.phase is Phase.AWAITING_KV and second.pages[:2] == shared
        second_fresh = second.pages[2:5]
        worker.abort(2, "client went away")  # prefill may still WRITE into the named pages
        held = worker.admission._quarantine.held.get(2)
        assert held is not None and held.pages[-3:] == second_fresh
        if offer:  # prefill may be READing the held prefix: a recycled page would feed it other KV
            assert held.pages[:2] == shared and all(engine.pool.allocator.holders_of(p) == {2} for p in shared)
        else:
            assert set(held.pages).isdisjoint(shared)
            assert all(engine.pool.allocator.holders_of(p) == set() for p in shared)  # let go at once
        await quarantine_emptied(worker)
        assert not worker.admission.has_quarantine and worker.coordinator.aborted == [2]
        assert engine.prefix_cache.num_pages == 2  # nothing of the failed room was cached

    asyncio.run(go())


def test_a_colocated_request_computes_from_the_end_of_its_hit(worker, engine):
    async def go():
        await first_round_cached(worker)
        job = await admitted(worker, 3, NEXT, prefill="")
        assert job.phase is Phase.PREFILLING and job.prefilled == job.cached_tokens == job.usage_cached_tokens == 32
        worker.abort(3, "done")  # ended PREFILLING having computed nothing more: no new pages cached
        assert engine.prefix_cache.num_pages == 2

    asyncio.run(go())


def test_a_salted_round_attaches_for_everything_but_what_its_own_salt_cached(worker, engine):
    salted = SamplingParams(temperature=0.0, max_tokens=4, cache_salt="tenant-1")

    async def go():
        await first_round_cached(worker)  # unsalted: PROMPT's two full pages
        second = await admitted(worker, 2, NEXT, params=salted)
        assert second.cached_tokens == 0 and worker.coordinator.attached[2][1] == 0
        assert worker.coordinator.offered[2] == []  # nothing of another tenant is offered for a READ
        arrive(worker, second)
        worker.emit(second, 6, -0.1)
        worker.abort(2, "client done")  # its four full pages stay cached, under its salt
        await asyncio.sleep(0)
        assert engine.prefix_cache.num_pages == 2 + 4
        third = await admitted(worker, 3, NEXT, params=salted)
        assert third.cached_tokens == 64 and worker.coordinator.attached[3][1] == 4
        fourth = await admitted(worker, 4, NEXT)
        assert fourth.cached_tokens == 32  # unsalted: only the unsalted round's pages
        for room in (3, 4):
            worker.abort(room, "done")
        await quarantine_emptied(worker)

    asyncio.run(go())


def test_reset_forgets_every_cached_page(worker, engine):
    async def go():
        await first_round_cached(worker)
        assert worker.reset_prefix_cache() == 2 and engine.pool.allocator.num_free == 32
        again = await admitted(worker, 2, PROMPT)
        assert again.cached_tokens == 0 and worker.coordinator.attached[2][1] == 0
        worker.abort(2, "done")
        await quarantine_emptied(worker)

    asyncio.run(go())


def counter(w, name):
    return w.metrics.registry.get_sample_value(f"pdmesh:{name}_total", w.metrics.labels) or 0.0
