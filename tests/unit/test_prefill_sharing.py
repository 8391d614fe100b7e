"""n > 1 on one prefill (services/prefill/sharing.py): the plan for each job of a share key, and
the prefill scheduler driven pass by pass on the random built-in model with a fake KV sender —
the prompt computed once, followers' KV an exact copy, their first tokens sampled with their own
seeds, and followers never left waiting on a leader that ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from services.common.faults import Faults
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.engine.runner import PrefillItem
from services.engine.worker_engine import WorkerEngine
from services.prefill.jobs import Job, Phase, PrefillResult
from services.prefill.sharing import Plan, ShareGroups
from services.prefill.worker import PrefillWorker
from services.transfer.state import RoomState

PROMPT = [40 + (i * 7) % 80 for i in range(40)]


def job(room: int, ids=PROMPT, key: int = 7) -> Job:
    return Job(room, list(ids), SamplingParams(), room, None, share_key=key)


# --- the plan (no torch) --------------------------------------------------------------------
def test_first_job_leads_and_later_ones_wait_then_copy():
    g = ShareGroups()
    a, b = job(1), job(2)
    assert g.plan(a) == (Plan.COMPUTE, None)
    g.lead(a)
    a.pages, a.prefilled = [0, 1, 2], 16  # a chunk of the leader done, more to come
    assert g.plan(b) == (Plan.WAIT, a)
    assert g.plan(b, final_in_batch={a}) == (Plan.COPY, a)  # the leader's final chunk is in this batch
    a.prefilled, a.last_logits = 40, object()
    assert g.plan(b) == (Plan.COPY, a)


def test_a_leader_that_ends_frees_its_followers_to_compute_and_one_of_them_leads():
    g = ShareGroups()
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


def test_a_finished_leader_is_not_copied_even_with_logits_kept():
    g = ShareGroups()
    a, b = job(1), job(2)
    g.lead(a)
    a.pages, a.prefilled, a.last_logits = [0], 40, object()
    a.phase = Phase.FINISHED  # finish() drops it too; kv_ready alone already says no
    assert not a.kv_ready and g.plan(b)[0] is Plan.WAIT
    g.drop(a)
    assert a.last_logits is None and g.plan(b)[0] is Plan.COMPUTE


def test_no_key_other_prompt_or_own_progress_compute_alone():
    g = ShareGroups()
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
    return WorkerEngine("builtin-random", "cpu", "float32", 64, 16)


def make_worker(engine, budget=512):
    engine.pool.kv.zero_()
    return PrefillWorker(engine, FakeSender(), Metrics("prefill", "m", "w"), Faults(), budget)


def counter(w, name):
    return w.metrics.registry.get_sample_value(f"pdmesh:{name}_total", w.metrics.labels) or 0.0


async def one_pass(w):
    batch, copies = w._pick_batch()
    await w._run_batch(batch, copies)
    return batch, copies


def sampled(engine, ids, seed):
    logits = engine.runner.prefill([PrefillItem(ids, 0, list(range(60, 63)))])  # pages no job holds
    return engine.sampler.sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [len(ids)], [(ids, ())])[0][0]


def submit(w, rooms, key=9, ids=PROMPT):
    return [w.submit(r, list(ids), SamplingParams(temperature=1.0, seed=100 + r), key) for r in rooms]


def test_one_forward_serves_the_group_and_each_follower_samples_its_own_first_token(engine):
    async def go():
        w = make_worker(engine)
        jobs = submit(w, [1, 2, 3, 4])
        batch, copies = await one_pass(w)
        assert [j for j, _ in batch] == [jobs[0]]  # the same batch is deduplicated: one computes
        assert [(f.room, ld.room) for f, ld in copies] == [(2, 1), (3, 1), (4, 1)]
        assert all(j.phase is Phase.INFLIGHT for j in jobs)
        kv = engine.pool.kv
        lead_pages = w.sender.sent[1][0]
        for j in jobs[1:]:
            pages = w.sender.sent[j.room][0]
            assert set(pages).isdisjoint(lead_pages) and torch.equal(kv[pages], kv[lead_pages])
        assert counter(w, "prompt_tokens") == len(PROMPT)
        assert counter(w, "shared_prompt_tokens") == 3 * len(PROMPT)
        return w, jobs

    w, jobs = asyncio.run(go())
    for j in jobs:  # each one's own seed, on the logits the prompt gives when computed alone
        assert w.sender.sent[j.room][1] == sampled(engine, PROMPT, 100 + j.room)


def test_followers_wait_for_a_chunked_leader_then_copy_when_its_final_chunk_runs(engine):
    async def go():
        w = make_worker(engine, budget=16)  # 40 tokens: the leader needs three forwards
        jobs = submit(w, [1, 2, 3])
        batch, copies = await one_pass(w)
        assert [j.room for j, _ in batch] == [1] and not copies
        assert all(j.pages is None and j.phase is Phase.QUEUED for j in jobs[1:])  # waiting holds no pages
        await one_pass(w)
        batch, copies = await one_pass(w)
        assert [j.room for j, _ in batch] == [1] and [f.room for f, _ in copies] == [2, 3]
        assert len(w.sender.sent) == 3 and counter(w, "prompt_tokens") == len(PROMPT)

    asyncio.run(go())


def test_followers_arriving_after_the_forward_copy_the_leader_while_it_sends(engine):
    async def go():
        w = make_worker(engine)
        submit(w, [1])
        await one_pass(w)
        submit(w, [2, 3])
        batch, copies = await one_pass(w)
        assert not batch and [f.room for f, _ in copies] == [2, 3]
        assert counter(w, "prompt_tokens") == len(PROMPT)
        # once the leader has ended (its transfer done), a late follower computes, and leads
        w.finish(w.jobs[1], PrefillResult(0, 0.0, len(PROMPT), 0, 0.0))
        submit(w, [4, 5])
        batch, copies = await one_pass(w)
        assert [j.room for j, _ in batch] == [4] and [f.room for f, _ in copies] == [5]
        assert counter(w, "prompt_tokens") == 2 * len(PROMPT)

    asyncio.run(go())


def test_a_leader_aborted_while_followers_wait_hands_the_prompt_to_the_next(engine):
    async def go():
        w = make_worker(engine, budget=16)
        jobs = submit(w, [1, 2, 3])
        await one_pass(w)
        w.abort(1, "client went away")
        assert jobs[0].finished and w.shares.leader_of(jobs[1]) is None
        batch, copies = await one_pass(w)
        assert [j.room for j, _ in batch] == [2] and not copies  # the next computes from scratch
        await one_pass(w)
        batch, copies = await one_pass(w)
        assert [f.room for f, _ in copies] == [3]
        assert counter(w, "prompt_tokens") == 16 + len(PROMPT)
        return w

    w = asyncio.run(go())
    assert set(w.sender.sent) == {2, 3}


def test_a_leader_aborted_mid_forward_keeps_its_pages_until_the_copy_is_done(engine):
    async def go():
        w = make_worker(engine)
        jobs = submit(w, [1, 2])
        free_before = engine.pool.allocator.num_free
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
        assert jobs[0].pages is None and jobs[1].phase is Phase.INFLIGHT
        w.abort(2, "client went away")
        assert engine.pool.allocator.num_free == free_before and not w.jobs

    asyncio.run(go())


def test_a_follower_aborted_while_waiting_leaves_the_rest_untouched(engine):
    async def go():
        w = make_worker(engine, budget=16)
        jobs = submit(w, [1, 2, 3])
        await one_pass(w)
        w.abort(2, "client went away")
        assert jobs[1].finished and 2 not in w.jobs
        await one_pass(w)
        batch, copies = await one_pass(w)
        assert [f.room for f, _ in copies] == [3] and counter(w, "prompt_tokens") == len(PROMPT)

    asyncio.run(go())


# --- prompt logprobs ---------------------------------------------------------------------------
def whole_prompt_logprobs(engine, ids, k):
    from services.engine.prompt_logprobs import reduce_chunk

    _, full = engine.runner.prefill_rows([PrefillItem(ids, 0, list(range(60, 63)))], [0])  # pages no job holds
    return reduce_chunk(full[0], ids[1:], k)


def test_a_chunked_leader_gathers_prompt_logprobs_and_its_followers_take_them(engine):
    async def go():
        w = make_worker(engine, budget=16)  # 40 tokens: three chunks
        jobs = [w.submit(r, list(PROMPT), SamplingParams(seed=r, prompt_logprobs=2), 9) for r in (1, 2)]
        for _ in range(3):
            await one_pass(w)
        assert all(j.phase is Phase.INFLIGHT for j in jobs)
        return jobs

    jobs = asyncio.run(go())
    want = whole_prompt_logprobs(engine, PROMPT, 2)
    for j in jobs:
        got = j.prompt_lp
        assert len(got) == len(PROMPT) - 1 and got.ranks == want.ranks and got.top_ids == want.top_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-5


def test_a_follower_asking_other_prompt_logprobs_computes_alone():
    g = ShareGroups()
    a, b = job(1), job(2)
    b.params = SamplingParams(prompt_logprobs=0)
    g.lead(a)
    a.pages, a.prefilled, a.last_logits = [0], 40, object()
    assert g.plan(b) == (Plan.COMPUTE, None)
