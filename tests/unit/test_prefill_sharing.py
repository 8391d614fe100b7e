"""n > 1 on one prefill (services/prefill/sharing.py): the plan for each job of a share key, and
the prefill scheduler driven pass by pass on the random built-in model with a fake KV sender —
the prompt's full pages computed once and taken by the followers from the prefix cache (the very
same pages, no copy), each follower computing only its tail and sampling its first token with
its own seed, followers never left waiting on a leader that ended, prompt-logprobs followers
and a worker without the cache computing alone. Every test ends with the pool whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.engine.page_allocator import PageAllocator
from services.engine.prefix_cache import PrefixCache
from services.engine.runner import PrefillItem
from services.engine.worker_engine import WorkerEngine
from services.prefill.jobs import Job, Phase, PrefillResult
from services.prefill.sharing import Plan, ShareGroups
from services.prefill.worker import PrefillWorker
from services.transfer.state import RoomState

P = 16
PROMPT = [40 + (i * 7) % 80 for i in range(40)]  # two full pages and 8 tokens
SHAREABLE = 32  # a follower takes the two full pages and computes the last 8 tokens


def job(room: int, ids=PROMPT, key: int = 7, params: SamplingParams | None = None) -> Job:
    return Job(room, list(ids), params or SamplingParams(), room, None, share_key=key)


def groups() -> ShareGroups:
    return ShareGroups(PrefixCache(PageAllocator(8), P))


# --- the plan (no torch) --------------------------------------------------------------------
def test_first_job_leads_and_later_ones_wait_until_its_full_pages_are_cached_then_follow():
    g = groups()
    a, b = job(1), job(2)
    assert g.plan(a) == (Plan.COMPUTE, None)
    g.lead(a)
    a.pages, a.prefilled = [0, 1, 2], 16  # a chunk of the leader done, more to come
    assert g.plan(b) == (Plan.WAIT, a)
    a.prefilled = SHAREABLE  # every page a follower can take is cached; the leader's tail is not
    assert g.plan(b) == (Plan.FOLLOW, a)
    a.prefilled = 40
    assert g.plan(b) == (Plan.FOLLOW, a)


def test_a_leader_that_ends_frees_its_followers_to_compute_and_one_of_them_leads():
    g = groups()
    a, b, c = job(1), job(2), job(3)
    g.lead(a)
    a.pages = [0]
    assert g.plan(b)[0] is Plan.WAIT
    a.phase = Phase.FINISHED
    g.drop(a)
    assert g.plan(b) == (Plan.COMPUTE, None)
    g.lead(b)
    b.pages = [1]
    assert g.plan(c) == (Plan.WAIT, b)


def test_no_key_other_prompt_or_own_progress_compute_alone():
    g = groups()
    a = job(1)
    g.lead(a)
    a.pages = [0]
    assert g.plan(job(2, key=0)) == (Plan.COMPUTE, None)
    assert g.plan(job(3, ids=PROMPT[:-1])) == (Plan.COMPUTE, None)
    started = job(4)
    started.pages, started.prefilled = [1], 16  # it computes its own prompt already
    assert g.plan(started) == (Plan.COMPUTE, None)
    g.lead(job(5, key=0))
    g.lead(job(6))  # the key has a leader: a second one does not replace it
    assert g.leader_of(job(7)) is a and len(g) == 1


def test_a_prompt_of_one_page_has_nothing_to_share_and_does_not_wait():
    g = groups()
    a, b = job(1, ids=PROMPT[:P]), job(2, ids=PROMPT[:P])
    g.lead(a)
    a.pages = [0]
    assert g.shareable(b) == 0 and g.plan(b) == (Plan.COMPUTE, None)
    assert g.shareable(job(3, ids=PROMPT[: P + 1])) == P  # one page and one token: the page is shared


def test_prompt_logprobs_jobs_neither_wait_nor_lead():
    g = groups()
    a = job(1)
    g.lead(a)
    a.pages = [0]
    asking = job(2, params=SamplingParams(prompt_logprobs=0))
    assert g.plan(asking) == (Plan.COMPUTE, None)  # it needs every position's logits: no cached page has them
    g2 = groups()
    g2.lead(asking)
    assert len(g2) == 0 and g2.plan(job(3)) == (Plan.COMPUTE, None)


# --- the scheduler, pass by pass ------------------------------------------------------------
class FakeSender:
    """The KV sender's surface the worker uses: every room is attached at once; send() records."""

    def __init__(self):
        self.rooms: dict[int, SimpleNamespace] = {}
        self.sent: dict[int, tuple[list[int], int]] = {}
        self.on_terminal = self.on_attached = None

    def create_room(self, room):
        self.rooms[room] = SimpleNamespace(state=RoomState.WAITING_FOR_INPUT, attach=None)  # no held prefix offered

    def abort(self, room, reason):
        return room in self.rooms

    def fail(self, room, reason):
        if room in self.rooms:
            self.rooms[room].state = RoomState.FAILED

    def release(self, room):
        self.rooms.pop(room, None)

    def free_when_quiesced(self, room, free):
        free()

    def send(self, room, pages, token, logprob, cached_tokens=0):
        self.rooms[room].state = RoomState.TRANSFERRING
        self.sent[room] = (list(pages), token)


@pytest.fixture(scope="module")
def engine():
    return WorkerEngine("builtin-random", "cpu", "float32", 64, P, prefix_cache=True)


@pytest.fixture(scope="module")
def engine_without_cache():
    return WorkerEngine("builtin-random", "cpu", "float32", 64, P)


def make_worker(engine, budget=512):
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    engine.pool.kv.zero_()
    return PrefillWorker(engine, FakeSender(), Metrics("prefill", "m", "w"), Faults(), budget)


def end_all(w):
    """Every job still running ends as a delivered transfer; then every page is free, or cached
    with no holder."""
    for j in list(w.jobs.values()):
        w.finish(j, PrefillResult(j.first_token, 0.0, len(j.token_ids), 0, 0.0))
    assert not w.jobs
    (w.engine.prefix_cache or w.engine.pool.allocator).check_integrity()
    assert w.engine.pool.allocator.is_whole()


def counter(w, name):
    return w.metrics.registry.get_sample_value(f"pdmesh:{name}_total", w.metrics.labels) or 0.0


async def one_pass(w):
    batch = w._pick_batch()
    await w._run_batch(batch)
    return [(j.room, n) for j, n in batch]


def from_scratch(engine, ids, seed):
    """KV and first token (temperature 1, `seed`) of ids computed alone, into pages no job holds."""
    alloc = engine.pool.allocator
    pages = alloc.alloc(engine.pool.pages_for_tokens(len(ids)), owner="scratch")
    try:
        logits = engine.runner.prefill([PrefillItem(ids, 0, pages)])
        token = engine.sampler.sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [len(ids)], [(ids, ())])
        return engine.pool.kv[pages].clone(), token[0][0]
    finally:
        alloc.free(pages, owner="scratch")


def submit(w, rooms, key=9, ids=PROMPT):
    return [w.submit(r, list(ids), SamplingParams(temperature=1.0, seed=100 + r), key) for r in rooms]


def test_followers_take_the_leaders_pages_from_the_cache_and_sample_their_own_first_tokens(engine):
    w = make_worker(engine)

    async def go():
        jobs = submit(w, [1, 2, 3, 4])
        assert await one_pass(w) == [(1, 40)]  # the followers wait for the leader's pages
        assert all(j.pages is None and j.phase is Phase.QUEUED for j in jobs[1:])  # waiting holds no pages
        assert await one_pass(w) == [(2, 8), (3, 8), (4, 8)]  # each computes only its tail
        assert all(j.phase is Phase.INFLIGHT for j in jobs)

    asyncio.run(go())
    lead_pages = w.sender.sent[1][0]
    want_kv, _ = from_scratch(engine, PROMPT, 0)
    for j in (2, 3, 4):
        pages, token = w.sender.sent[j]
        assert pages[:2] == lead_pages[:2] and pages[2] != lead_pages[2]  # the same pages, refcounted; its own tail
        torch.testing.assert_close(engine.pool.kv[pages[2]][:, :, :8], want_kv[2][:, :, :8], rtol=1e-5, atol=1e-5)
    assert engine.pool.allocator.holders_of(lead_pages[0]) == {1, 2, 3, 4}
    for j in (1, 2, 3, 4):  # each one's own seed, on the logits the prompt gives when computed alone
        assert w.sender.sent[j][1] == from_scratch(engine, PROMPT, 100 + j)[1]
    assert counter(w, "prompt_tokens") == 40 + 3 * 8
    assert counter(w, "prefix_cache_hits") == counter(w, "shared_prompt_tokens") == 3 * SHAREABLE
    end_all(w)


def test_followers_wait_for_a_chunked_leader_until_its_full_pages_are_cached(engine):
    w = make_worker(engine, budget=16)  # 40 tokens: the leader needs three forwards

    async def go():
        submit(w, [1, 2, 3])
        assert await one_pass(w) == [(1, 16)]
        assert await one_pass(w) == [(1, 16)]  # the second page is not cached until this returns
        # the leader's last 8 tokens and the first follower's share the budget; the next follows
        assert await one_pass(w) == [(1, 8), (2, 8)]
        assert await one_pass(w) == [(3, 8)]
        assert len(w.sender.sent) == 3

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 2 * 8 and counter(w, "shared_prompt_tokens") == 2 * SHAREABLE
    end_all(w)


def test_followers_arriving_after_the_forward_follow_at_once_and_after_the_leader_ended_lead_anew(engine):
    w = make_worker(engine)

    async def go():
        submit(w, [1])
        await one_pass(w)
        submit(w, [2, 3])
        assert await one_pass(w) == [(2, 8), (3, 8)]
        # once the leader has ended (its transfer done), a late arrival leads; its cache lookup
        # still finds the pages, and the next one of the key follows it in the same pass
        w.finish(w.jobs[1], PrefillResult(0, 0.0, len(PROMPT), 0, 0.0))
        later = submit(w, [4, 5])
        assert await one_pass(w) == [(4, 8), (5, 8)]
        assert w.shares.leader_of(later[1]) is later[0]

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 4 * 8
    assert counter(w, "prefix_cache_hits") == 4 * SHAREABLE
    assert counter(w, "shared_prompt_tokens") == 3 * SHAREABLE  # the new leader followed nobody
    end_all(w)


def test_a_leader_aborted_while_followers_wait_hands_the_prompt_to_the_next(engine):
    w = make_worker(engine, budget=16)

    async def go():
        jobs = submit(w, [1, 2, 3])
        await one_pass(w)
        w.abort(1, "client went away")
        assert jobs[0].finished and w.shares.leader_of(jobs[1]) is None
        # the next computes on from the page the aborted leader cached, and leads; the last follows it
        assert await one_pass(w) == [(2, 16)] and jobs[1].cached_tokens == 16
        assert await one_pass(w) == [(2, 8), (3, 8)]

    asyncio.run(go())
    assert set(w.sender.sent) == {2, 3}
    assert counter(w, "prompt_tokens") == 40 + 8  # the common prompt still computed once
    end_all(w)


def test_a_leader_aborted_mid_forward_lets_go_of_its_pages_and_the_follower_computes(engine):
    w = make_worker(engine)

    async def go():
        jobs = submit(w, [1, 2])
        real_run = engine.run

        async def abort_then_run(fn, *args):  # the abort lands while the batch is in the forward
            w.abort(1, "client went away")
            assert jobs[0].finished and jobs[0].pages is not None  # released when the forward returns
            return await real_run(fn, *args)

        engine.run = abort_then_run
        try:
            await one_pass(w)
        finally:
            del engine.run
        assert jobs[0].pages is None and engine.pool.allocator.pages_of(1) == []
        assert await one_pass(w) == [(2, 40)]  # nothing of the leader's forward was kept
        assert jobs[1].phase is Phase.INFLIGHT

    asyncio.run(go())
    end_all(w)


def test_a_follower_aborted_while_waiting_leaves_the_rest_untouched(engine):
    w = make_worker(engine, budget=16)

    async def go():
        jobs = submit(w, [1, 2, 3])
        await one_pass(w)
        w.abort(2, "client went away")
        assert jobs[1].finished and 2 not in w.jobs
        await one_pass(w)
        assert await one_pass(w) == [(1, 8), (3, 8)]

    asyncio.run(go())
    assert counter(w, "prompt_tokens") == 40 + 8
    end_all(w)


# --- computing alone ---------------------------------------------------------------------------
def whole_prompt_logprobs(engine, ids, k):
    from services.engine.prompt_logprobs import reduce_chunk

    pages = engine.pool.allocator.alloc(engine.pool.pages_for_tokens(len(ids)), owner="scratch")
    try:
        _, full = engine.runner.prefill_rows([PrefillItem(ids, 0, pages)], [0])
        return reduce_chunk(full[0], ids[1:], k)
    finally:
        engine.pool.allocator.free(pages, owner="scratch")


def test_followers_asking_prompt_logprobs_compute_alone_and_get_every_position(engine):
    w = make_worker(engine)

    async def go():
        jobs = [w.submit(r, list(PROMPT), SamplingParams(seed=r, prompt_logprobs=2), 9) for r in (1, 2)]
        assert await one_pass(w) == [(1, 40), (2, 40)]
        assert all(j.phase is Phase.INFLIGHT and j.cached_tokens == 0 for j in jobs)
        return jobs

    jobs = asyncio.run(go())
    want = whole_prompt_logprobs(engine, PROMPT, 2)
    for j in jobs:
        got = j.prompt_lp
        assert len(got) == len(PROMPT) - 1 and got.ranks == want.ranks and got.top_ids == want.top_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5
    assert counter(w, "prompt_tokens") == 2 * 40 and counter(w, "shared_prompt_tokens") == 0
    end_all(w)


def test_without_the_prefix_cache_the_choices_compute_independently(engine_without_cache):
    w = make_worker(engine_without_cache)
    assert w.shares is None

    async def go():
        submit(w, [1, 2, 3])
        assert await one_pass(w) == [(1, 40), (2, 40), (3, 40)]  # side by side, nobody waits

    asyncio.run(go())
    for j in (1, 2, 3):
        assert w.sender.sent[j][1] == from_scratch(engine_without_cache, PROMPT, 100 + j)[1]
    assert counter(w, "prompt_tokens") == 3 * 40 and counter(w, "shared_prompt_tokens") == 0
    end_all(w)
