"""The prefill worker's core: jobs, the scheduler loop, and the one way a job ends.

The asyncio loop owns every job and the KV sender; the only other thread is the engine thread
that runs forwards. A job's phases are in services/prefill/jobs.py; the sender's room state
says whether decode has attached and whether the KV WRITE is done.

Every outcome — KV delivered, transfer failed, abort, watchdog eviction, a forward that raised
or outlived --forward-timeout — goes through `finish(job, outcome)`, which delivers it to the
RPC once; the job's pages go back to the pool in `_release`, exactly once, and never while a
forward still computes into them (the scheduler releases finished jobs when the forward returns).

Scheduling (`_pick_batch`): jobs that already hold pages are scheduled first — they only need
compute, and finishing them is what returns pages. Pages go to new jobs in order — vLLM's
priority (the router's --scheduling-policy priority; 0 for all under fcfs), then arrival; when
the first waiting job cannot get its pages, no later job gets any either, so a stream of small
prompts cannot starve a large one: the pages it needs come back as the jobs ahead finish.

Prefix cache (services/engine/prefix_cache.py, --prefix-cache): when a job takes its pages it
first takes the longest cached prefix of its prompt (shared pages, at least one token left to
compute), then fresh pages for the rest, and computes only that rest; after each chunk its full
computed pages join the cache. Its pages are only ever written past the cached prefix, in pages
of its own. The shared pages are let go with the job's others, when nothing reads them any more.

Decode's held prefix (--kv-read-held-prefix, services/transfer/reader.py): decode's Attach names
the prompt pages it holds (a conversation's previous prompt *and reply*, which this worker never
saw). A job whose own hit is shorter READs the rest of them into its fresh pages, before its
first forward (a job is scheduled only once attached, so the offer is always known by then):
phase READING, one READ bounded by --kv-read-timeout. Verified pages join the cache and count as
cached tokens; whatever fails, the job computes those tokens (never a failed request for it).

n > 1 (services/prefill/sharing.py): jobs of one share key compute their common prompt once,
through the prefix cache: a follower waits (holding no pages) until its leader has cached the
full pages it can take, then takes them as any hit and computes only its tail, sampling its own
first token. With the cache off the choices compute independently. `pdmesh:prompt_tokens_total`
counts the tokens a forward computed, `pdmesh:prefix_cache_hits_total` those found cached, and
`pdmesh:shared_prompt_tokens_total` the part of those hits a follower took from its leader.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from services.common.faults import Faults
from services.common.logging_setup import bound_room, get_logger
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.engine.page_allocator import OutOfPages
from services.engine.prefix_cache_metrics import count_lookup, watch_prefix_cache
from services.engine.prompt_logprobs import chunk_targets
from services.engine.runner import PrefillItem
from services.engine.sampler import TopLogprobs
from services.engine.worker_engine import WorkerEngine
from services.prefill.forward import PromptRows, Sample, run_batch
from services.prefill.jobs import Job, Phase, PrefillResult, RoomFailed
from services.prefill.sharing import Plan, ShareGroups
from services.transfer.reader import ReadOutcome
from services.transfer.sender import KVSender, SenderRoom
from services.transfer.state import RoomState

log = get_logger("prefill")

__all__ = ["PrefillWorker", "Job", "PrefillResult", "RoomFailed"]


class PrefillWorker:
    def __init__(
        self,
        engine: WorkerEngine,
        sender: KVSender,
        metrics: Metrics,
        faults: Faults,
        chunk_budget: int,
        read_held_prefix: bool = True,
    ):
        self.engine = engine
        self.read_held_prefix = read_held_prefix
        self.sender = sender
        self.metrics = metrics
        self.faults = faults
        self.chunk_budget = chunk_budget
        self.jobs: dict[int, Job] = {}
        self._forward: list[Job] = []  # the jobs whose chunks the engine is computing now
        # n > 1 shares through the prefix cache: without it the choices compute independently
        self.shares = ShareGroups(engine.prefix_cache) if engine.prefix_cache is not None else None
        self._seq = itertools.count()
        self._work = asyncio.Event()
        sender.on_terminal = self._on_sender_terminal
        sender.on_attached = lambda _room: self.kick()
        m = metrics
        m.gauge_from("num_prefill_prealloc_queue_reqs", lambda: self._count(Phase.QUEUED, RoomState.BOOTSTRAPPING))
        m.gauge_from("num_queue_reqs", lambda: self._count(Phase.QUEUED, RoomState.WAITING_FOR_INPUT)
                     + self._count(Phase.READING))
        m.gauge_from("num_running_reqs", lambda: self._count(Phase.FORWARD))
        m.gauge_from("num_prefill_inflight_queue_reqs", lambda: self._count(Phase.INFLIGHT))
        m.pool_gauges(engine.pool)
        watch_prefix_cache(m, engine.prefix_cache)

    # --- queries ---------------------------------------------------------------------------
    def _state(self, job: Job) -> RoomState | None:
        r = self.sender.rooms.get(job.room)
        return r.state if r is not None else None

    def _count(self, phase: Phase, state: RoomState | None = None) -> int:
        return sum(1 for j in self.jobs.values() if j.phase is phase and (state is None or self._state(j) == state))

    def load(self) -> tuple[int, int]:
        """(queued, running): rooms waiting for decode or the engine; rooms in a forward or inflight."""
        return (self._count(Phase.QUEUED) + self._count(Phase.READING),
                self._count(Phase.FORWARD) + self._count(Phase.INFLIGHT))

    def forward_rooms(self) -> list[int]:
        return [j.room for j in self._forward]

    # --- requests --------------------------------------------------------------------------
    def submit(self, room: int, token_ids: list[int], params: SamplingParams, share_key: int = 0,
               canary: bool = False) -> Job:
        """Register a Prefill RPC's room (raises DuplicateRoom). Attach may already be parked."""
        job = Job(room, token_ids, params, next(self._seq), asyncio.get_running_loop().create_future(),
                  share_key=share_key, canary=canary)
        self.sender.create_room(room)
        self.jobs[room] = job
        if not canary:
            self.metrics.inc(self.metrics.num_requests)
        self.kick()
        return job

    def abort(self, room: int, reason: str) -> bool:
        """Abort from the router (RPC cancelled / Abort RPC) or from decode."""
        known = self.sender.abort(room, reason)  # also refuses an attach parked for this room
        job = self.jobs.get(room)
        if job is not None and not job.finished:
            self.metrics.inc(self.metrics.num_aborted_requests)
            self.finish(job, RoomFailed(reason, "CANCELLED"))
        return known or job is not None

    def evict(self, room: int, queue: str, age: float, deadline: float) -> None:
        """The watchdog's verdict on one entry."""
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        state = self._state(job)
        with bound_room(room):
            log.warning(
                "watchdog eviction", queue=queue, state=state.label if state else None,
                age_s=round(age, 3), deadline_s=deadline,
            )
        self.metrics.inc(self.metrics.watchdog_evictions, queue=queue)
        if queue == "bootstrap":
            self.metrics.inc(self.metrics.num_bootstrap_failed_reqs)
        reason = f"watchdog: {age:.1f}s in the {queue} queue exceeds its {deadline:g}s deadline"
        self.finish(job, RoomFailed(reason, "DEADLINE_EXCEEDED"))

    def fail_stuck_forward(self, reason: str) -> None:
        """The current forward outlived --forward-timeout: fail its rooms now. Their pages come
        back when (if) the forward returns."""
        for job in list(self._forward):
            self.finish(job, RoomFailed(reason, "UNAVAILABLE"))

    def kick(self) -> None:
        self._work.set()

    # --- the one way a job ends ------------------------------------------------------------
    def finish(self, job: Job, outcome: PrefillResult | RoomFailed) -> None:
        """Deliver the job's outcome once; release its pages unless a forward still uses them."""
        if job.finished:
            return
        was = job.phase
        job.phase = Phase.FINISHED
        if self.shares is not None:
            self.shares.drop(job)  # its followers, if any, compute themselves on the next pass
        if isinstance(outcome, RoomFailed):
            if was is Phase.INFLIGHT and outcome.code == "UNAVAILABLE":
                self.metrics.inc(self.metrics.num_transfer_failed_reqs)
            # ends the transfer too: releases its NIXL handle, tells decode (no-op if terminal)
            self.sender.fail(job.room, outcome.reason)
            if not job.future.done():
                job.future.set_exception(outcome)
        elif not job.future.done():
            job.future.set_result(outcome)
        if job not in self._forward:
            self._release(job)
        self.kick()  # freed pages may unblock waiting jobs

    def _release(self, job: Job) -> None:
        """Exactly once per job: pages back to the pool, the sender forgets the room."""
        if self.jobs.pop(job.room, None) is None:
            return
        if job.params.lora_name:
            self.engine.detach_retired_loras(self.jobs.values())
        if job.pages is not None:
            # a NIXL handle that could not be released yet may still read these pages: the
            # sender frees them once nothing references the room (at once in the usual case)
            pages, room, allocator = job.pages, job.room, self.engine.pool.allocator
            self.sender.free_when_quiesced(room, lambda: (allocator.free(pages, owner=room), self.kick()))
            job.pages = None
        self.sender.release(job.room)

    def _on_sender_terminal(self, r: SenderRoom) -> None:
        # Called from inside the sender: only schedule, act on the loop's next turn.
        asyncio.get_running_loop().call_soon(self._on_transfer_end, r.room, r.state, r.reason, r)

    def _on_transfer_end(self, room: int, state: RoomState, reason: str | None, r: SenderRoom) -> None:
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        if state == RoomState.SUCCESS:
            seconds = (r.done_at or time.monotonic()) - (r.posted_at or time.monotonic())
            self.metrics.transferred(seconds, r.nbytes)
            self.finish(job, PrefillResult(job.first_token, job.first_logprob, len(job.token_ids), r.nbytes, seconds,
                                           job.first_top, job.cached_tokens, job.prompt_lp))
        else:
            self.finish(job, RoomFailed(reason or "failed"))

    # --- scheduling ------------------------------------------------------------------------
    def _plan(self, job: Job) -> tuple[Plan, Job | None]:
        return self.shares.plan(job) if self.shares is not None else (Plan.COMPUTE, None)

    def _pick_batch(self) -> list[tuple[Job, int]]:
        """(job, tokens of its next chunk) under the chunk budget; see the module docstring."""
        ready = [j for j in self.jobs.values() if j.phase is Phase.QUEUED and self._state(j) == RoomState.WAITING_FOR_INPUT]
        ready.sort(key=lambda j: (j.pages is None, j.order))  # page holders first, then priority and arrival
        budget, batch = self.chunk_budget, []
        for job in ready:
            plan, _leader = self._plan(job)
            if plan is Plan.WAIT:
                continue  # its leader is computing the pages it will take from the cache
            if budget <= 0:
                break
            if job.pages is None:
                try:
                    self._take_pages(job, followed=plan is Plan.FOLLOW)
                except OutOfPages:
                    break  # later jobs wait too: the first in order gets the pages that come back
                if job.phase is Phase.READING:
                    continue  # its READ brings part of its prompt first; it computes the rest after
            n = min(budget, job.remaining)
            if self.shares is not None:
                self.shares.lead(job)
            batch.append((job, n))
            budget -= n
        return batch

    def _take_pages(self, job: Job, followed: bool = False) -> None:
        """The job's pages: its prompt's longest cached prefix (shared), then fresh ones for the
        rest. Raises OutOfPages with nothing taken. A job asking for prompt logprobs does not read
        the cache (it needs every prompt position's logits, services/engine/prompt_logprobs.py)
        but still inserts what it computed. `followed`: an n > 1 follower whose leader cached the
        pages it finds (counted apart as well)."""
        pool, cache = self.engine.pool, self.engine.prefix_cache
        use_cache = cache is not None and job.params.prompt_logprobs is None
        hit = []
        if cache is not None:
            job.cache_keys = cache.keys(job.token_ids, job.params.cache_salt, job.params.lora_name)  # once: every chunk's insert reuses them
        if use_cache:
            hit = cache.acquire(job.token_ids, job.room, keys=job.cache_keys)
        try:
            fresh = pool.allocator.alloc(pool.pages_for_tokens(len(job.token_ids)) - len(hit), owner=job.room)
        except OutOfPages:
            pool.allocator.free(hit, owner=job.room)
            raise
        job.pages = hit + fresh
        job.cached_tokens = job.prefilled = len(hit) * pool.page_size
        if use_cache:
            count_lookup(self.metrics, cache, len(job.token_ids), job.cached_tokens)
            if followed and not job.canary:
                self.metrics.inc(self.metrics.shared_prompt_tokens, job.cached_tokens)
            self._read_held_prefix(job, len(hit))

    def _read_held_prefix(self, job: Job, hit: int) -> None:
        """The prompt pages decode holds beyond this worker's hit of `hit` pages: READ them into
        the job's fresh pages (phase READING until the READ ends), if decode offered them."""
        r = self.sender.rooms.get(job.room)
        if not self.read_held_prefix or r is None or r.attach is None:
            return
        # a hit leaves one prompt token to compute (its logits give the first token); decode's
        # offer obeys the same rule, min() only guards against a peer that does not
        stop = min(len(r.attach.held_pages), self.engine.prefix_cache.max_hit_pages(len(job.token_ids)))
        if stop <= hit:
            return
        job.phase = Phase.READING
        job.read_pages = stop - hit
        outcome = self.sender.start_read(job.room, job.pages[hit:stop], hit, lambda o: self._on_read_end(job, o))
        if outcome is not None:
            self._on_read_end(job, outcome)

    def _on_read_end(self, job: Job, outcome: ReadOutcome) -> None:
        """The READ ended and NIXL let go of its handle: the pages are the job's own again."""
        if job.finished:
            return
        job.phase = Phase.QUEUED
        page_size = self.engine.pool.page_size
        start = job.prefilled // page_size
        stop = start + job.read_pages
        m = self.metrics
        if outcome.ok:
            self.engine.prefix_cache.insert(job.token_ids, job.pages, stop, job.cache_keys)
            job.prefilled = job.cached_tokens = stop * page_size
            m.inc(m.kv_read_pages, outcome.pages)
            m.inc(m.kv_read_bytes, outcome.nbytes)
            m.observe(m.kv_read_latency, outcome.seconds)
        else:
            m.inc(m.kv_read_failures, reason=outcome.reason)
            with bound_room(job.room):
                log.warning("READ of decode's held prefix failed; computing those tokens", reason=outcome.reason,
                            detail=outcome.detail, pages=outcome.pages, seconds=round(outcome.seconds, 3))
        job.read_pages = 0
        self.kick()

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (reset_prefix_cache); pages running jobs hold stay theirs.
        Returns the entries dropped."""
        cache = self.engine.prefix_cache
        if cache is None:
            return 0
        dropped = cache.clear()
        log.info("prefix cache reset", pages=dropped)
        self.kick()  # pages came free
        return dropped

    async def schedule_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while batch := self._pick_batch():
                await self._run_batch(batch)

    async def _run_batch(self, batch: list[tuple[Job, int]]) -> None:
        items = [PrefillItem(j.token_ids[j.prefilled : j.prefilled + n], j.prefilled, j.pages, j.params.lora_name)
                 for j, n in batch]
        finals = [i for i, (j, n) in enumerate(batch) if n == j.remaining]
        final_jobs = [batch[i][0] for i in finals]
        # the history feeds penalties / logit_bias / min_tokens
        sample = Sample([j.params for j in final_jobs], [len(j.token_ids) for j in final_jobs],
                        [(j.token_ids, ()) for j in final_jobs])
        prompt_rows = [PromptRows(i, chunk_targets(j.token_ids, j.prefilled, n), j.params.prompt_logprobs)
                       for i, (j, n) in enumerate(batch) if j.params.prompt_logprobs is not None]
        engine = self.engine

        self._forward = [j for j, _ in batch]
        now = time.monotonic()
        for j, _ in batch:
            if j.prefilled == 0:  # its first forward: the end of its time in the queues
                self.metrics.observe(self.metrics.queue_time, now - j.created_at)
        for j in self._forward:
            j.phase = Phase.FORWARD
        error: Exception | None = None
        try:
            tokens, logprobs, tops, prompt = await engine.run(run_batch, engine, items, finals, sample, prompt_rows)
        except Exception as e:  # noqa: BLE001 - a failed forward fails its rooms, not the worker
            log.exception("prefill forward failed", rooms=[j.room for j in self._forward])
            error, tokens, logprobs, tops, prompt = e, [], [], [], {}
        prompt_of = {batch[i][0]: lp for i, lp in prompt.items()}
        self._forward = []
        sampled = dict(zip(final_jobs, zip(tokens, logprobs, tops, strict=True), strict=False))
        for job, chunk in batch:
            if job.finished:  # aborted, evicted or timed out mid-forward: its release waited for us
                self._release(job)
            elif error is not None:
                self.finish(job, RoomFailed(f"forward failed: {type(error).__name__}: {error}"))
            elif self._state(job) != RoomState.WAITING_FOR_INPUT:  # transfer layer ended it; its callback finishes it
                job.phase = Phase.QUEUED
            else:
                if job.params.prompt_logprobs is not None:
                    self._gather_prompt_logprobs(job, prompt_of[job])
                self._advance(job, chunk, sampled.get(job))

    @staticmethod
    def _gather_prompt_logprobs(job: Job, computed) -> None:
        """A chunk adds its positions' prompt logprobs."""
        if job.prompt_lp is None:
            job.prompt_lp = computed
        else:
            job.prompt_lp.extend(computed)

    def _advance(self, job: Job, chunk: int, first: tuple[int, float, TopLogprobs | None] | None) -> None:
        """A job's chunk succeeded: count it, cache its full pages (followers of its share key
        take them from there), and send the KV once the whole prompt is there."""
        if not job.canary:
            self.metrics.inc(self.metrics.prompt_tokens, chunk)
        job.prefilled += chunk
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.insert(job.token_ids, job.pages, job.prefilled // self.engine.pool.page_size,
                                            job.cache_keys)
        if first is None:
            job.phase = Phase.QUEUED
            return
        job.first_token, job.first_logprob, job.first_top = first
        job.phase = Phase.INFLIGHT
        self.sender.send(job.room, job.pages, job.first_token, job.first_logprob, job.cached_tokens)
