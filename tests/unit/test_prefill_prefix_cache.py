"""The prefill scheduler with the prefix cache, pass by pass on the random built-in model with a
fake KV sender: a prompt that extends a cached one computes only its suffix, its KV and first
token equal a computation from scratch, shared pages are never written, and after the jobs end
every page is free or cached with no holder."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.engine.runner import PrefillItem
from services.prefill.jobs import PrefillResult
from services.prefill.worker import PrefillWorker
from tests.unit.prefix_cache_engine import empty_cache_then_whole_pool, random_engine_with_prefix_cache
from tests.unit.test_prefill_sharing import FakeSender

P = 16
GREEDY = SamplingParams(temperature=0.0)
HISTORY = [40 + (i * 7) % 80 for i in range(40)]  # two full pages and a partial one
NEXT = HISTORY + [30 + (i * 5) % 60 for i in range(30)]  # the next round: 70 tokens, 4 full pages


@pytest.fixture(scope="module")
def engine():
    return random_engine_with_prefix_cache(64, P)


@pytest.fixture
def worker(engine):
    with empty_cache_then_whole_pool(engine, zero_kv=True):
        yield PrefillWorker(engine, FakeSender(), Metrics("prefill", "m", "w"), Faults(), 512)


def counter(w, name):
    return w.metrics.registry.get_sample_value(f"pdmesh:{name}_total", w.metrics.labels) or 0.0


def gauge(w, name):
    return w.metrics.registry.get_sample_value(f"pdmesh:{name}", w.metrics.labels)


async def serve(w, room, ids, budget=512, params=GREEDY):
    """Submit, run passes until the KV is 'sent', then end the job as a delivered transfer."""
    w.chunk_budget = budget
    job = w.submit(room, list(ids), params)
    while room not in w.sender.sent:
        batch = w._pick_batch()
        assert batch, "the job made no progress"
        await w._run_batch(batch)
    pages, token = w.sender.sent[room]
    kv = w.engine.pool.kv[pages].clone()
    w.finish(job, PrefillResult(token, 0.0, len(ids), 0, 0.0, None, job.cached_tokens))
    return job, pages, token, kv


def from_scratch(engine, ids):
    """KV and greedy first token of ids computed in one forward into pages no job holds."""
    alloc = engine.pool.allocator
    pages = alloc.alloc(engine.pool.pages_for_tokens(len(ids)), owner="scratch")
    try:
        logits = engine.runner.prefill([PrefillItem(list(ids), 0, pages)])
        return engine.pool.kv[pages].clone(), int(logits[0].argmax())
    finally:
        alloc.free(pages, owner="scratch")


def test_the_next_round_computes_only_its_suffix_and_matches_a_computation_from_scratch(worker, engine):
    async def go():
        first, pages1, _, _ = await serve(worker, 1, HISTORY)
        assert first.cached_tokens == 0 and counter(worker, "prompt_tokens") == 40
        assert gauge(worker, "prefix_cache_pages") == 2
        second, pages2, token, kv = await serve(worker, 2, NEXT)
        return pages1, second, pages2, token, kv

    pages1, second, pages2, token, kv = asyncio.run(go())
    assert second.cached_tokens == 32 and pages2[:2] == pages1[:2]
    assert counter(worker, "prompt_tokens") == 40 + 38  # the second round computed 70 - 32 tokens
    assert counter(worker, "prefix_cache_queries") == 40 + 70
    assert counter(worker, "prefix_cache_hits") == 32
    assert gauge(worker, "cache_hit_rate") == pytest.approx(32 / 110)
    assert gauge(worker, "prefix_cache_pages") == 4  # the second round's 4 full pages
    ref_kv, ref_token = from_scratch(engine, NEXT)
    assert token == ref_token
    used = len(NEXT) % P  # the last page holds 6 tokens; the rest of it is not the prompt's
    torch.testing.assert_close(kv[:-1], ref_kv[:-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[-1][:, :, :used], ref_kv[-1][:, :, :used], rtol=1e-5, atol=1e-5)


def test_a_salted_round_finds_only_the_pages_of_its_own_salt(worker, engine):
    salted = SamplingParams(temperature=0.0, cache_salt="tenant-1")

    async def go():
        await serve(worker, 1, HISTORY)  # unsalted: 2 full pages cached
        other, _, token_other, _ = await serve(worker, 2, NEXT, params=salted)
        assert other.cached_tokens == 0  # the unsalted history is another tenant's
        assert gauge(worker, "prefix_cache_pages") == 2 + 4
        again, _, token_again, _ = await serve(worker, 3, NEXT, params=salted)
        assert again.cached_tokens == 64  # its own salt: every full page but the last token's
        unsalted, _, _, _ = await serve(worker, 4, NEXT)
        assert unsalted.cached_tokens == 32  # the unsalted history's two pages, not the salted four
        return token_other, token_again

    token_other, token_again = asyncio.run(go())
    assert token_other == token_again == from_scratch(engine, NEXT)[1]  # a salt changes what is found, not the result


def test_a_shared_page_is_never_written_and_a_fully_cached_prompt_still_computes_its_last_page(worker, engine):
    async def go():
        _, pages1, token1, _ = await serve(worker, 1, HISTORY[:32])  # exactly two pages, both cached
        cached = engine.pool.kv[pages1[:2]].clone()
        again, pages2, token2, _ = await serve(worker, 2, HISTORY[:32])
        assert again.cached_tokens == 16 and pages2[0] == pages1[0] and pages2[1] != pages1[1]
        assert token2 == token1 and torch.equal(engine.pool.kv[pages1[:2]], cached)
        assert counter(worker, "prompt_tokens") == 32 + 16

    asyncio.run(go())


def test_chunks_cache_their_full_pages_as_they_complete(worker, engine):
    async def go():
        job = worker.submit(1, list(NEXT), GREEDY)
        worker.chunk_budget = 24
        await worker._run_batch(worker._pick_batch())
        assert engine.prefix_cache.num_pages == 1  # 24 tokens: one full page, half of the next
        await worker._run_batch(worker._pick_batch())
        assert engine.prefix_cache.num_pages == 3
        other = worker.submit(2, list(NEXT[:50]), GREEDY)  # arrives mid-prompt: hits 3 pages
        await worker._run_batch(worker._pick_batch())
        assert other.cached_tokens == 48
        while 1 not in worker.sender.sent or 2 not in worker.sender.sent:
            await worker._run_batch(worker._pick_batch())
        for j in (job, other):
            worker.finish(j, PrefillResult(0, 0.0, len(j.token_ids), 0, 0.0))
        assert other.phase.name == "FINISHED"

    asyncio.run(go())


def test_reset_drops_every_entry_and_the_next_request_computes_everything(worker, engine):
    async def go():
        await serve(worker, 1, HISTORY)
        assert worker.reset_prefix_cache() == 2 and engine.pool.allocator.num_free == 64
        again, _, _, _ = await serve(worker, 2, HISTORY)
        assert again.cached_tokens == 0 and counter(worker, "prompt_tokens") == 80

    asyncio.run(go())


def test_cached_pages_are_evicted_when_a_prompt_needs_the_pool(worker, engine):
    async def go():
        await serve(worker, 1, HISTORY)
        big = [7 + i % 90 for i in range(63 * P)]  # 63 pages: 62 free + one evicted cached page
        job, _, _, _ = await serve(worker, 2, big, budget=2048)
        assert job.cached_tokens == 0 and counter(worker, "prefix_cache_evictions") == 1
        assert len(engine.prefix_cache.match([*HISTORY, 1])) == 1  # its tail page went first, its head stays
        assert counter(worker, "prefix_cache_queries") == len(HISTORY) + len(big)

    asyncio.run(go())


def test_a_job_that_cannot_get_its_pages_takes_no_shared_page_either(worker, engine):
    async def go():
        await serve(worker, 1, HISTORY)
        hog = engine.pool.allocator.alloc(engine.pool.allocator.num_free, owner="hog")
        job = worker.submit(2, list(NEXT), GREEDY)
        assert worker._pick_batch() == []  # two pages cached, three more needed: none free
        assert job.pages is None and engine.pool.allocator.holders_of(0) == set()
        engine.pool.allocator.free(hog, owner="hog")
        worker.abort(2, "test over")

    asyncio.run(go())


def test_a_job_asking_for_prompt_logprobs_does_not_read_the_cache(worker, engine):
    w, ids = worker, list(range(40, 90))

    async def go():
        first = w.submit(1, ids, SamplingParams())
        await w._run_batch(w._pick_batch())
        w.finish(first, PrefillResult(0, 0.0, len(ids), 0, 0.0))
        assert engine.prefix_cache.match(ids)  # its full pages are cached
        asking = w.submit(2, ids, SamplingParams(prompt_logprobs=1))
        await w._run_batch(w._pick_batch())
        # recomputed: every prompt token went through the forward and has its logprob
        assert asking.cached_tokens == 0 and len(asking.prompt_lp) == len(ids) - 1
        assert counter(w, "prompt_tokens") == 2 * len(ids)
        w.finish(asking, PrefillResult(0, 0.0, len(ids), 0, 0.0))

    asyncio.run(go())


def test_waiting_jobs_are_taken_by_priority_then_arrival(worker):
    # a budget of one prompt a pass: each pass computes the first waiting job in order (the
    # prompts differ, so that none finds another's pages in the cache and needs less)
    w = worker
    w.chunk_budget = len(HISTORY)

    def prompt(room):
        return [(room * 37 + i * 7) % 120 + 1 for i in range(len(HISTORY))]

    async def run():
        jobs = {room: w.submit(room, prompt(room), SamplingParams(temperature=0.0, priority=priority))
                for room, priority in ((1, 0), (2, 5), (3, -1), (4, 0))}
        taken = []
        for _ in jobs:
            batch = w._pick_batch()
            assert len(batch) == 1
            job = batch[0][0]
            taken.append(job.room)
            await w._run_batch(batch)
            assert job.room in w.sender.sent  # computed whole: out of the queue
            w.finish(job, PrefillResult(w.sender.sent[job.room][1], 0.0, len(HISTORY), 0, 0.0, None, 0))
        return taken

    assert asyncio.run(run()) == [3, 1, 4, 2]
