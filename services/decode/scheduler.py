"""Decode's continuous-batching loop: schedule -> run -> postprocess, with retraction.

Each pass first resumes retracted requests whose KV can be recomputed now, then builds a step's
batch in order — vLLM's priority, then arrival (`Job.order`; arrival alone under the router's
default fcfs policy) — growing each request's pages by one when its next token needs it,
runs one decode forward on the engine thread, and hands each sampled token to the worker.
Colocated jobs (no prefill worker) get their prompt computed here: each pass runs one chunked
local prefill forward before the decode step (services/decode/local_prefill.py).
When the pool runs dry, the running request last in that order gives its pages back
(services/decode/retraction.py) and later recomputes its KV from prompt + generated tokens.

`in_forward` lists the jobs whose pages the engine is using right now; a job that finishes
meanwhile (abort, eviction, --forward-timeout) is released when the forward returns.
"""

from __future__ import annotations

import asyncio

from services.common.logging_setup import bound_room, get_logger
from services.decode.jobs import Job, Phase
from services.decode.local_prefill import pick_chunks, run_chunks
from services.decode.retraction import choose_victim
from services.engine.page_allocator import OutOfPages
from services.engine.runner import DecodeItem, PrefillItem

log = get_logger("decode.scheduler")


class DecodeScheduler:
    def __init__(self, worker, max_running: int, chunk_budget: int = 512):
        self.worker = worker  # services.decode.worker.DecodeWorker
        self.engine = worker.engine
        self.pool = worker.engine.pool
        self.max_running = max_running
        if chunk_budget < 1:
            raise ValueError("--chunked-prefill-size must be at least 1")
        self.chunk_budget = chunk_budget  # tokens of one local prefill forward (colocated jobs)
        self.in_forward: list[Job] = []
        self._work = asyncio.Event()

    def wake(self) -> None:
        self._work.set()

    def _jobs(self, phase: Phase) -> list[Job]:
        return sorted((j for j in self.worker.jobs.values() if j.phase is phase), key=lambda j: j.order)

    async def loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while True:
                await self._resume_retracted()
                chunks = pick_chunks(list(self.worker.jobs.values()), self.chunk_budget)
                if chunks:
                    await run_chunks(self, chunks)
                batch = self._schedule()
                if batch:
                    await self._run(batch)
                elif not chunks:
                    break

    # --- schedule ----------------------------------------------------------------------------
    def _schedule(self) -> list[Job]:
        """This step's batch in order (priority, then arrival), each job's pages grown to fit its
        next token; when the pool runs dry, jobs later in that order are retracted to make room."""
        batch: list[Job] = []
        running = self._jobs(Phase.RUNNING)
        for i, job in enumerate(running):
            if len(batch) >= self.max_running:
                break
            if job.phase is not Phase.RUNNING:  # retracted earlier in this pass, for an earlier job
                continue
            if not self.pool.can_ever_hold(job.context_len):
                self._fail_outgrown(job, job.context_len)
                continue
            while self.pool.pages_for_tokens(job.context_len) > len(job.pages):
                try:
                    job.pages += self.pool.allocator.alloc(1, owner=job.room)
                    continue
                except OutOfPages:
                    pass
                later = [j for j in running[i + 1:] if j.phase is Phase.RUNNING]
                others = self.worker.admission.has_quarantine or any(
                    j.pages for j in self.worker.jobs.values() if j.phase in (Phase.ATTACHING, Phase.AWAITING_KV, Phase.PREFILLING)
                )
                decision = choose_victim(job, later, not batch, others)
                if decision.fail:
                    self.worker.fail(job, "out of KV pages while decoding", "RESOURCE_EXHAUSTED")
                    break
                self._retract(decision.victim)
                if decision.victim is job:
                    break
            if job.phase is Phase.RUNNING:
                batch.append(job)
        return batch

    def _fail_outgrown(self, job: Job, tokens: int) -> None:
        self.worker.fail(job, f"context of {tokens} tokens outgrew the KV pool "
                              f"({self.pool.num_pages} pages of {self.pool.page_size})", "RESOURCE_EXHAUSTED")

    def _retract(self, job: Job) -> None:
        """Give the job's pages back; it leaves the batch and waits to recompute its KV."""
        with bound_room(job.room):
            log.warning("retracted: out of KV pages", pages=len(job.pages),
                        context_tokens=job.context_len - 1, free_pages=self.pool.allocator.num_available)
        self.worker.metrics.inc(self.worker.metrics.num_retractions)
        # its KV arrived long ago: prefill writes nothing more into these pages
        self.pool.allocator.free(job.pages, owner=job.room)
        job.pages = None
        job.phase = Phase.RETRACTED

    async def _resume_retracted(self) -> None:
        """Recompute the KV of retracted jobs (prompt + generated tokens, in order) as
        pages allow, then return them to the batch. The last generated token is not in the
        cache: the next decode step feeds it, exactly as for a job that never left."""
        retracted = self._jobs(Phase.RETRACTED)
        if not retracted:
            return
        resumed: list[Job] = []
        # Headroom: leave a page of growth for every request in the batch, or the next page
        # one of them needs would retract the job just recomputed (thrashing). With nothing
        # running, a job resumes as soon as its context fits.
        headroom = len(self._jobs(Phase.RUNNING))
        for job in retracted:
            if not self.pool.can_ever_hold(job.context_len):  # could never resume: fail, don't wait forever
                self._fail_outgrown(job, job.context_len)
                continue
            need = self.pool.pages_for_tokens(job.context_len)
            if self.pool.allocator.num_available < need + headroom:
                break  # in order: a later job does not jump ahead of an earlier one
            job.pages = self.pool.allocator.alloc(need, owner=job.room)
            resumed.append(job)
            headroom += 1
        if resumed:
            items = [PrefillItem(j.token_ids + j.output[:-1], 0, list(j.pages), j.params.lora_name) for j in resumed]
            error = await self._forward(resumed, lambda: self.engine.runner.prefill(items))
            for job in resumed:
                if job.finished:  # ended during the recompute: its release waited for the forward
                    self.worker.release(job)
                elif isinstance(error, Exception):
                    self.worker.fail(job, f"recompute after retraction failed: {type(error).__name__}: {error}", "INTERNAL")
                else:
                    job.phase = Phase.RUNNING
                    with bound_room(job.room):
                        log.info("resumed after retraction", pages=len(job.pages))
        if not self._jobs(Phase.RETRACTED):
            self.worker.admission.wake()  # admission waited for the retracted requests to resume

    # --- run and postprocess -------------------------------------------------------------------
    async def _forward(self, jobs: list[Job], fn):
        """Run fn on the engine thread with `jobs` marked as in the forward. Returns fn's result,
        or the exception it raised (a failed forward fails its requests, not the worker)."""
        self.in_forward = jobs
        try:
            return await self.engine.run(fn)
        except Exception as e:  # noqa: BLE001
            log.exception("decode forward failed", rooms=[j.room for j in jobs])
            return e
        finally:
            self.in_forward = []

    async def _run(self, batch: list[Job]) -> None:
        engine = self.engine
        positions = [j.context_len - 1 for j in batch]  # the last token goes in here
        items = [DecodeItem(j.output[-1], p, list(j.pages), j.params.lora_name)
                 for j, p in zip(batch, positions, strict=True)]
        params = [j.params for j in batch]
        histories = [(j.token_ids, j.output) for j in batch]  # for penalties / logit_bias / min_tokens / grammar
        rooms = [j.room for j in batch]  # grammar matchers are cached per room

        def forward():
            logits = engine.runner.decode(items)
            return engine.sampler.sample_full(logits, params, [p + 1 for p in positions], histories, rooms)

        result = await self._forward(batch, forward)
        if isinstance(result, Exception):
            for job in batch:
                if job.finished:
                    self.worker.release(job)
                else:
                    self.worker.fail(job, f"decode step failed: {type(result).__name__}: {result}", "INTERNAL")
            return
        overruns = self.grammar_overruns()
        for job, tok, lp, top in zip(batch, *result, strict=True):
            if job.finished:  # ended mid-step: its release waited for the step
                self.worker.release(job)
            elif job.room in overruns:
                self.fail_overrun(job, overruns[job.room])
            else:
                self.worker.emit(job, tok, lp, top)

    def grammar_overruns(self) -> dict:
        """Rooms whose grammar overran the per-step budget in the forward just done."""
        grammars = getattr(self.engine, "grammars", None)
        return grammars.take_overruns() if grammars is not None else {}

    def fail_overrun(self, job: Job, seconds: float) -> None:
        """A grammar too expensive to follow fails its own room; the others never wait on it again."""
        budget = self.engine.grammars.step_budget
        self.worker.fail(job, f"the grammar took {seconds:.2f} s of CPU for one token, over this worker's "
                              f"--grammar-step-budget of {budget} s: it is too expensive to enforce", "INVALID_ARGUMENT")
