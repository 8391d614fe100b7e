"""The prefill scheduler READing decode's held prefix, pass by pass on the random built-in model:
a job whose own hit is shorter than what decode offers takes the rest from decode's pages and
computes only the suffix (its KV and first token equal a computation from scratch, and
prompt_tokens_total counts only what its forward computed); while the READ runs the job is not
scheduled; a failed READ computes those tokens; a job aborted mid-READ lets go of its pages.
"Decode's" pages are pages of the same pool computed from scratch; the fake sender's READ copies
them (the real READ, checksums and deadline: tests/unit/test_transfer_reader.py and the mesh)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.engine.runner import PrefillItem
from services.prefill.jobs import Phase, PrefillResult
from services.prefill.worker import PrefillWorker
from services.transfer.reader import ReadOutcome
from tests.unit.prefix_cache_engine import empty_cache_then_whole_pool, random_engine_with_prefix_cache
from tests.unit.test_prefill_prefix_cache import GREEDY, HISTORY, NEXT, P, counter, from_scratch, gauge
from tests.unit.test_prefill_sharing import FakeSender


def copy_pages(pool, src, dst):
    """What a verified READ leaves in the pool: decode's pages' KV in the job's own."""
    pool.kv[dst] = pool.kv[src]


class ReadSender(FakeSender):
    """Every room is attached with decode's offer `held`; start_read copies those pages now
    (`mode` "now"), later (`complete()`), or fails ("fail")."""

    def __init__(self, pool, held):
        super().__init__()
        self.pool, self.held, self.mode, self.pending = pool, held, "now", {}

    def create_room(self, room):
        super().create_room(room)
        self.rooms[room].attach = SimpleNamespace(held_pages=tuple(self.held))

    def start_read(self, room, local, first, on_end):
        src = list(self.held[first : first + len(local)])
        if self.mode == "fail":
            return ReadOutcome(False, len(local), 0, 0.01, "checksum", "differs")
        if self.mode == "now":
            copy_pages(self.pool, src, list(local))
            return ReadOutcome(True, len(local), len(local) * self.pool.page_nbytes, 0.01)
        self.pending[room] = (src, list(local), on_end)
        return None

    def complete(self, room):
        src, local, on_end = self.pending.pop(room)
        copy_pages(self.pool, src, local)
        on_end(ReadOutcome(True, len(local), len(local) * self.pool.page_nbytes, 0.02))


@pytest.fixture(scope="module")
def engine():
    return random_engine_with_prefix_cache(64, P)


@pytest.fixture
def decode_pages(engine):
    """NEXT's first four full pages as decode holds them (its max hit for 70 tokens: 69 // 16)."""
    with empty_cache_then_whole_pool(engine, zero_kv=True):
        pages = engine.pool.allocator.alloc(4, owner="decode")
        engine.runner.prefill([PrefillItem(NEXT[: 4 * P], 0, pages)])
        yield pages
        engine.pool.allocator.free(pages, owner="decode")


def make_worker(engine, held, read=True):
    return PrefillWorker(engine, ReadSender(engine.pool, held), Metrics("prefill", "m", "w"), Faults(), 512,
                         read_held_prefix=read)


async def run_until_sent(w, room):
    while room not in w.sender.sent:
        batch = w._pick_batch()
        assert batch, "the job made no progress"
        await w._run_batch(batch)
    pages, token = w.sender.sent[room]
    return pages, token, w.engine.pool.kv[pages].clone()


def assert_like_scratch(engine, token, kv):
    ref_kv, ref_token = from_scratch(engine, NEXT)
    used = len(NEXT) % P
    assert token == ref_token
    torch.testing.assert_close(kv[:-1], ref_kv[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[-1][:, :, :used], ref_kv[-1][:, :, :used], rtol=1e-5, atol=1e-5)


async def first_round(w):
    held, w.sender.held = w.sender.held, ()  # the first round: decode holds nothing yet
    job = w.submit(1, list(HISTORY), GREEDY)
    w.sender.held = held
    await run_until_sent(w, 1)
    w.finish(job, PrefillResult(0, 0.0, len(HISTORY), 0, 0.0))  # prefill now caches HISTORY's 2 pages


async def second_round_submitted(w):
    """The first round done, the next one (NEXT, room 2) submitted: its job."""
    await first_round(w)
    return w.submit(2, list(NEXT), GREEDY)


def test_the_pages_decode_holds_beyond_the_own_hit_are_read_and_only_the_suffix_is_computed(engine, decode_pages):
    w = make_worker(engine, decode_pages)

    async def go():
        job = await second_round_submitted(w)
        pages, token, kv = await run_until_sent(w, 2)
        assert job.cached_tokens == 64 and job.prefilled == len(NEXT)
        assert_like_scratch(engine, token, kv)
        assert engine.prefix_cache.match(NEXT) == pages[:4]  # the pages read joined the cache
        w.finish(job, PrefillResult(token, 0.0, len(NEXT), 0, 0.0))

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 6  # what the forwards computed: 70 - 4 pages
    assert counter(w, "prefix_cache_hits") == 32  # the cache gave two pages; the READ brought two
    assert counter(w, "kv_read_pages") == 2 and counter(w, "kv_read_bytes") == 2 * engine.pool.page_nbytes


def test_a_job_is_not_scheduled_while_its_read_runs(engine, decode_pages):
    w = make_worker(engine, decode_pages)
    w.sender.mode = "later"

    async def go():
        job = await second_round_submitted(w)
        assert w._pick_batch() == []  # it took its pages and started the READ
        assert job.phase is Phase.READING and gauge(w, "num_queue_reqs") == 1 and w.load() == (1, 0)
        assert w._pick_batch() == []
        w.sender.complete(2)
        assert job.phase is Phase.QUEUED and job.prefilled == 64
        pages, token, kv = await run_until_sent(w, 2)
        assert_like_scratch(engine, token, kv)
        w.finish(job, PrefillResult(token, 0.0, len(NEXT), 0, 0.0))

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 6


@pytest.mark.parametrize("read", [True, False])
def test_a_failed_or_disabled_read_computes_those_tokens_and_gives_the_same_kv(engine, decode_pages, read):
    w = make_worker(engine, decode_pages, read=read)
    w.sender.mode = "fail"

    async def go():
        job = await second_round_submitted(w)
        pages, token, kv = await run_until_sent(w, 2)
        assert job.cached_tokens == 32
        assert_like_scratch(engine, token, kv)
        w.finish(job, PrefillResult(token, 0.0, len(NEXT), 0, 0.0))

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 38 and counter(w, "kv_read_pages") == 0
    failures = w.metrics.registry.get_sample_value("pdmesh:kv_read_failures_total",
                                                   {**w.metrics.labels, "reason": "checksum"})
    assert failures == (1 if read else 0)


def test_a_job_aborted_during_its_read_lets_go_of_its_pages(engine, decode_pages):
    w = make_worker(engine, decode_pages)
    w.sender.mode = "later"

    async def go():
        job = await second_round_submitted(w)
        w._pick_batch()
        assert job.phase is Phase.READING
        w.abort(2, "client went away")
        assert job.finished and 2 not in w.jobs and engine.pool.allocator.pages_of(2) == []
        w.sender.complete(2)  # a late end (the real sender cancels it): nothing happens
        assert job.finished and counter(w, "kv_read_pages") == 0

    asyncio.run(go())
