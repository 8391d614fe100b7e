"""The decode worker's core: jobs, page allocation, attach, the continuous-batching loop.

The asyncio loop owns every job and the KV receiver; forwards run on the engine thread.
A job's life (DESIGN.md §2-§3):

  prealloc (room Bootstrapping: waiting for KV pages, then attaching to prefill)
  -> transfer (WaitingForInput: prefill computing, bounded by its liveness;
               Transferring: prefill said forward done, bounded by --transfer-timeout)
  -> running (KV and first token arrived; joins the decode batch between steps)
     <-> retracted (out of pages: gave its pages back, recomputes its KV when pages free up)
  -> finished (stop / length) or failed (any stage)

Pages grow on demand while decoding; when none is left, the latest-arrived running request is
retracted (services/decode/retraction.py). Cleanup runs exactly once per job and never while
its pages are inside a running forward.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from dataclasses import dataclass, field

import grpc

from services.common.faults import Faults
from services.common.logging_setup import bound_room, get_logger
from services.common.metrics import Metrics
from services.decode.retraction import choose_victim
from services.engine.local_generate import is_stop
from services.engine.page_allocator import OutOfPages
from services.engine.runner import DecodeItem, PrefillItem
from services.common.sampling_params import SamplingParams
from services.engine.worker_engine import WorkerEngine
from services.transfer.bootstrap import BootstrapCallError, KVReceiveCoordinator
from services.transfer.receiver import KVReceiver, ReceiverRoom
from services.transfer.state import RoomState

log = get_logger("decode")


class DecodeFailed(Exception):
    def __init__(self, reason: str, code: str = "UNAVAILABLE"):
        super().__init__(reason)
        self.reason = reason
        self.code = code  # gRPC status code name


@dataclass
class Tokens:
    """One streamed chunk."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    completion_tokens: int


@dataclass(eq=False)
class Job:
    room: int
    token_ids: list[int]
    params: SamplingParams
    prefill_addr: str
    seq: int
    out: asyncio.Queue  # Tokens | DecodeFailed
    created_at: float = field(default_factory=time.monotonic)
    pages: list[int] | None = None
    attaching: bool = False
    attach_sent: bool = False  # prefill knows our pages: it may WRITE into them until it lets go
    running: bool = False
    retracted: bool = False  # left the batch for lack of pages; resumes by recomputing its KV
    in_forward: bool = False
    finished: bool = False
    output: list[int] = field(default_factory=list)
    last_token_at: float | None = None


class DecodeWorker:
    def __init__(
        self,
        engine: WorkerEngine,
        receiver: KVReceiver,
        coordinator: KVReceiveCoordinator,
        metrics: Metrics,
        faults: Faults,
        max_running: int,
        quarantine_max: float = 60.0,
        quarantine_retry: float = 0.5,
    ):
        self.engine = engine
        self.receiver = receiver
        self.coordinator = coordinator
        self.metrics = metrics
        self.faults = faults
        self.max_running = max_running
        self.jobs: dict[int, Job] = {}
        # Pages of rooms that failed after prefill learned their ids, held back until prefill
        # confirms it let go of the room (or is gone): a late WRITE must not land in pages
        # already handed to another request.
        self.quarantined: dict[int, list[int]] = {}
        self.quarantine_max = quarantine_max
        self.quarantine_retry = quarantine_retry
        self._seq = itertools.count()
        self._alloc_work = asyncio.Event()
        self._decode_work = asyncio.Event()
        self._froze_once = False
        self._bg: set[asyncio.Task] = set()
        receiver.on_terminal = self._on_receiver_terminal
        m = metrics
        m.gauge_from("num_decode_prealloc_queue_reqs", lambda: self.count_states(RoomState.BOOTSTRAPPING))
        m.gauge_from(
            "num_decode_transfer_queue_reqs",
            lambda: self.count_states(RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING),
        )
        m.gauge_from("num_running_reqs", lambda: sum(1 for j in self.jobs.values() if j.running))
        m.gauge_from("num_retracted_reqs", lambda: sum(1 for j in self.jobs.values() if j.retracted))
        m.gauge_from("token_usage", lambda: engine.pool.token_usage)

    # --- queries ---------------------------------------------------------------------------
    def _state(self, job: Job) -> RoomState | None:
        r = self.receiver.rooms.get(job.room)
        return r.state if r is not None else None

    def count_states(self, *states: RoomState) -> int:
        return sum(1 for j in self.jobs.values() if not j.running and self._state(j) in states)

    def load(self) -> tuple[int, int]:
        """(queued, running): rooms waiting for pages or KV; requests in the decode batch."""
        running = sum(1 for j in self.jobs.values() if j.running)
        return len(self.jobs) - running, running

    # --- requests --------------------------------------------------------------------------
    def submit(self, room: int, token_ids: list[int], params: SamplingParams, prefill_addr: str) -> Job:
        """Register a Decode RPC's room (raises DuplicateRoom); it enters the prealloc queue."""
        job = Job(room, token_ids, params, prefill_addr, next(self._seq), asyncio.Queue())
        self.receiver.create_room(room, prefill_addr)
        self.jobs[room] = job
        self.metrics.inc(self.metrics.num_requests)
        self._alloc_work.set()
        return job

    def abort(self, room: int, reason: str) -> bool:
        """Abort from the router (RPC cancelled / Abort RPC). Exactly-once cleanup follows."""
        job = self.jobs.get(room)
        if job is None or job.finished:
            return False
        self.metrics.inc(self.metrics.num_aborted_requests)
        self._fail(job, reason, "CANCELLED")
        return True

    def evict(self, room: int, queue: str, age: float, deadline: float) -> None:
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
        counter = self.metrics.num_bootstrap_failed_reqs if queue == "prealloc" else self.metrics.num_transfer_failed_reqs
        self.metrics.inc(counter)
        self._fail(
            job,
            f"watchdog: {age:.1f}s in the {queue} queue exceeds its {deadline:g}s deadline",
            "DEADLINE_EXCEEDED",
        )

    # --- failure and cleanup ---------------------------------------------------------------
    def _fail(self, job: Job, reason: str, code: str) -> None:
        if job.finished:
            return
        job.finished = True
        with bound_room(job.room):
            log.info("decode room failed", reason=reason, code=code)
        job.out.put_nowait(DecodeFailed(reason, code))
        self.receiver.fail(job.room, reason)
        if not job.in_forward and not job.attaching:
            self._cleanup(job)

    def _cleanup(self, job: Job) -> None:
        """Exactly once: pages back to the pool, receiver forgets the room, job removed."""
        if self.jobs.pop(job.room, None) is None:
            return
        if job.pages is not None:
            if job.attach_sent and not job.running:
                self.quarantined[job.room] = job.pages
                self._spawn(self._release_when_prefill_lets_go(job.room, job.prefill_addr, job.pages))
            else:
                self.engine.pool.allocator.free(job.pages, owner=job.room)
            job.pages = None
        self.receiver.release(job.room)
        self._pages_freed()

    async def _release_when_prefill_lets_go(self, room: int, prefill_addr: str, pages: list[int]) -> None:
        """Abort the room on prefill, then free its quarantined pages. Prefill lets go when it
        answers the abort (it fails the room and cancels its WRITE) or when it is gone
        (connection refused: nothing can write any more). A prefill that does not answer
        (frozen) keeps the pages quarantined, retried, for at most `quarantine_max` seconds."""
        client = self.coordinator.client(prefill_addr)
        give_up = time.monotonic() + self.quarantine_max
        with bound_room(room):
            while True:
                try:
                    await client.abort(room, "decode released the room", self.receiver.agent_name)
                    break
                except BootstrapCallError as e:
                    if e.code == grpc.StatusCode.UNAVAILABLE:
                        log.info("prefill gone: releasing quarantined pages", prefill=prefill_addr)
                        break
                    if time.monotonic() > give_up:
                        log.warning("prefill never confirmed the abort: releasing quarantined pages",
                                    prefill=prefill_addr, error=str(e))
                        break
                except Exception as e:  # noqa: BLE001 - e.g. a protocol mismatch: nothing more to wait for
                    log.warning("abort to prefill failed: releasing quarantined pages", error=str(e))
                    break
                await asyncio.sleep(self.quarantine_retry)
        del self.quarantined[room]
        self.engine.pool.allocator.free(pages, owner=room)
        self._pages_freed()

    def _pages_freed(self) -> None:
        self._alloc_work.set()
        if any(j.retracted for j in self.jobs.values()):
            self._decode_work.set()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # --- KV arrival ------------------------------------------------------------------------
    def _on_receiver_terminal(self, r: ReceiverRoom) -> None:
        asyncio.get_running_loop().call_soon(self._on_kv, r.room, r.state, r.reason, r.result)

    def _on_kv(self, room: int, state: RoomState, reason: str | None, row) -> None:
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        if state != RoomState.SUCCESS:
            if job.pages is not None:
                self.metrics.inc(self.metrics.num_transfer_failed_reqs)
            self._fail(job, reason or "KV transfer failed", "UNAVAILABLE")
            return
        job.running = True
        self._emit(job, row.token, row.logprob)
        if not job.finished:
            self._decode_work.set()

    def _emit(self, job: Job, token: int, logprob: float) -> None:
        now = time.monotonic()
        if job.last_token_at is None:
            self.metrics.observe(self.metrics.time_to_first_token, now - job.created_at)
        else:
            self.metrics.observe(self.metrics.inter_token_latency, now - job.last_token_at)
        job.last_token_at = now
        job.output.append(token)
        self.metrics.inc(self.metrics.generation_tokens)
        eos = self.engine.config.eos_token_ids
        finish = ""
        if is_stop(token, job.params, eos):
            finish = "stop"
        elif len(job.output) >= job.params.max_tokens:
            finish = "length"
        job.out.put_nowait(Tokens([token], [logprob], finish, len(job.output)))
        if finish:
            job.finished = True
            self.metrics.observe(self.metrics.e2e_request_latency, now - job.created_at)
            if not job.in_forward:
                self._cleanup(job)

    # --- prealloc: pages, then attach --------------------------------------------------------
    async def prealloc_loop(self) -> None:
        pool = self.engine.pool
        while True:
            await self._alloc_work.wait()
            self._alloc_work.clear()
            if any(j.retracted for j in self.jobs.values()):
                continue  # retracted requests get freed pages first (the decode loop resumes them)
            waiting = sorted(
                (j for j in self.jobs.values() if j.pages is None and not j.finished and not j.retracted),
                key=lambda j: j.seq,
            )
            for job in waiting:
                # prompt KV plus room for the first decode step; more pages come on demand
                need = pool.pages_for_tokens(len(job.token_ids) + 1)
                try:
                    job.pages = pool.allocator.alloc(need, owner=job.room)
                except OutOfPages:
                    break  # FIFO: the head waits for pages (bounded by --prealloc-timeout)
                job.attaching = True
                job.attach_sent = True
                self._spawn(self._attach(job))

    async def _attach(self, job: Job) -> None:
        prompt_pages = job.pages[: self.engine.pool.pages_for_tokens(len(job.token_ids))]
        try:
            ok = await self.coordinator.attach(job.room, job.prefill_addr, prompt_pages)
        finally:
            job.attaching = False
        if job.finished:  # failed (abort, watchdog) while the attach RPC was in flight
            self._cleanup(job)
            return
        if not ok:
            r = self.receiver.rooms.get(job.room)
            self.metrics.inc(self.metrics.num_bootstrap_failed_reqs)
            self._fail(job, (r.reason if r else None) or "attach failed", "UNAVAILABLE")
            return
        if self.faults.sigstop_after_attach and not self._froze_once:
            self._froze_once = True
            log.warning("FAULT INJECTION: freezing this process (SIGSTOP) right after attach", room=job.room)
            os.kill(os.getpid(), signal.SIGSTOP)

    # --- continuous batching -----------------------------------------------------------------
    async def decode_loop(self) -> None:
        while True:
            await self._decode_work.wait()
            self._decode_work.clear()
            while True:
                await self._resume_retracted()
                batch = self._pick_batch()
                if not batch:
                    break
                await self._step(batch)

    def _pick_batch(self) -> list[Job]:
        """This step's batch in arrival order, each job's pages grown to fit its next token;
        when the pool runs dry, later arrivals are retracted to make room."""
        pool = self.engine.pool
        batch: list[Job] = []
        running = sorted((j for j in self.jobs.values() if j.running and not j.finished), key=lambda j: j.seq)
        for i, job in enumerate(running):
            if len(batch) >= self.max_running:
                break
            if not job.running:  # retracted earlier in this pass, to make room for an earlier job
                continue
            position = len(job.token_ids) + len(job.output) - 1  # the last token goes in here
            if not pool.can_ever_hold(position + 1):
                self._fail_outgrown(job, position + 1)
                continue
            need = pool.pages_for_tokens(position + 1)
            while need > len(job.pages):
                try:
                    job.pages += pool.allocator.alloc(1, owner=job.room)
                    continue
                except OutOfPages:
                    pass
                later = [j for j in running[i + 1:] if j.running]
                others = bool(self.quarantined) or any(
                    j.pages for j in self.jobs.values() if not j.running and not j.finished
                )
                decision = choose_victim(job, later, not batch, others)
                if decision.fail:
                    self._fail(job, "out of KV pages while decoding", "RESOURCE_EXHAUSTED")
                    break
                self._retract(decision.victim)
                if decision.victim is job:
                    break
            if job.running and not job.finished:
                batch.append(job)
        return batch

    def _fail_outgrown(self, job: Job, tokens: int) -> None:
        pool = self.engine.pool
        self._fail(job, f"context of {tokens} tokens outgrew the KV pool "
                        f"({pool.num_pages} pages of {pool.page_size})", "RESOURCE_EXHAUSTED")

    def _retract(self, job: Job) -> None:
        """Give the job's pages back; it leaves the batch and waits to recompute its KV."""
        with bound_room(job.room):
            log.warning("retracted: out of KV pages", pages=len(job.pages),
                        context_tokens=len(job.token_ids) + len(job.output) - 1,
                        free_pages=self.engine.pool.allocator.num_free)
        self.metrics.inc(self.metrics.num_retractions)
        self.engine.pool.allocator.free(job.pages, owner=job.room)
        job.pages = None
        # its KV arrived long ago: prefill writes nothing more into whatever pages it gets next
        job.attach_sent = False
        job.running = False
        job.retracted = True

    async def _resume_retracted(self) -> None:
        """Recompute the KV of retracted jobs (prompt + generated tokens, in arrival order) as
        pages allow, then return them to the batch. The last generated token is not in the
        cache: the next decode step feeds it, exactly as for a job that never left."""
        pool = self.engine.pool
        resumed: list[Job] = []
        # Headroom: leave a page of growth for every request in the batch, or the next page
        # one of them needs would retract the job just recomputed (thrashing). With nothing
        # running, a job resumes as soon as its context fits.
        headroom = sum(1 for j in self.jobs.values() if j.running and not j.finished)
        for job in sorted((j for j in self.jobs.values() if j.retracted and not j.finished), key=lambda j: j.seq):
            context = len(job.token_ids) + len(job.output) - 1
            if not pool.can_ever_hold(context + 1):  # could never resume: fail rather than wait forever
                self._fail_outgrown(job, context + 1)
                continue
            need = pool.pages_for_tokens(context + 1)
            if pool.allocator.num_free < need + headroom:
                break  # arrival order: a later job does not jump ahead of an earlier one
            job.pages = pool.allocator.alloc(need, owner=job.room)
            resumed.append(job)
            headroom += 1
        if not resumed:
            return
        items = [PrefillItem(j.token_ids + j.output[:-1], 0, list(j.pages)) for j in resumed]
        for j in resumed:
            j.in_forward = True
        try:
            await self.engine.run(lambda: self.engine.runner.prefill(items))
            error = None
        except Exception as e:  # noqa: BLE001 - a failed recompute fails its requests, not the worker
            log.exception("recompute of retracted requests failed", rooms=[j.room for j in resumed])
            error = e
        for job in resumed:
            job.in_forward = False
            if job.finished:  # aborted during the recompute: its cleanup waited for the forward
                self._cleanup(job)
                continue
            job.retracted = False
            if error is not None:
                self._fail(job, f"recompute after retraction failed: {type(error).__name__}: {error}", "INTERNAL")
                continue
            job.running = True
            with bound_room(job.room):
                log.info("resumed after retraction", pages=len(job.pages))

    async def _step(self, batch: list[Job]) -> None:
        engine = self.engine
        positions = [len(j.token_ids) + len(j.output) - 1 for j in batch]
        items = [DecodeItem(j.output[-1], p, list(j.pages)) for j, p in zip(batch, positions, strict=True)]
        params = [j.params for j in batch]

        def forward():
            logits = engine.runner.decode(items)
            return engine.sampler.sample(logits, params, [p + 1 for p in positions])

        for j in batch:
            j.in_forward = True
        try:
            tokens, logprobs = await engine.run(forward)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the worker
            log.exception("decode step failed", rooms=[j.room for j in batch])
            for j in batch:
                j.in_forward = False
                self._fail(j, f"decode step failed: {type(e).__name__}: {e}", "INTERNAL")
            return
        for job, tok, lp in zip(batch, tokens, logprobs, strict=True):
            job.in_forward = False
            if job.finished:  # aborted mid-step: its cleanup waited for the step
                self._cleanup(job)
                continue
            self._emit(job, tok, lp)
