"""The decode worker's core: the job table, KV arrival, token emission, and the one way a job ends.

The asyncio loop owns every job and the KV receiver; forwards run on the engine thread. The
concerns around a job live in their own files:

  services/decode/jobs.py        a job's phases (PREALLOC -> ATTACHING -> AWAITING_KV -> RUNNING
                                 <-> RETRACTED -> FINISHED) and what it streams
  services/decode/admission.py   pages for new rooms, the Attach to prefill, quarantine
  services/decode/scheduler.py   the continuous-batching loop and retraction
  services/decode/watchdog.py    the deadlines of the prealloc and transfer queues

Every outcome — stop, length, failure, abort, eviction, a forward that raised or outlived
--forward-timeout — goes through `finish(job, failure)`; `release(job)` then returns the pages
exactly once, and never while an attach RPC or a forward still uses them.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from services.common.faults import Faults
from services.common.logging_setup import bound_room, get_logger
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.decode.admission import Admission
from services.decode.jobs import PAGES_EXPOSED, DecodeFailed, Job, Phase, Tokens
from services.decode.scheduler import DecodeScheduler
from services.engine.local_generate import is_stop
from services.engine.prefix_cache_metrics import watch_prefix_cache
from services.engine.worker_engine import WorkerEngine
from services.transfer.bootstrap import KVReceiveCoordinator
from services.transfer.receiver import KVReceiver, ReceiverRoom
from services.transfer.state import DuplicateRoom, RoomState

log = get_logger("decode")

__all__ = ["DecodeWorker", "DecodeFailed", "Job", "Phase", "Tokens"]


class DecodeWorker:
    def __init__(
        self,
        engine: WorkerEngine,
        receiver: KVReceiver,
        coordinator: KVReceiveCoordinator,
        metrics: Metrics,
        faults: Faults,
        max_running: int,
        chunk_budget: int = 512,
        quarantine_max: float = 60.0,
        quarantine_retry: float = 0.5,
        quarantine_unreachable_hold: float = 0.0,
        offer_held_prefix: bool = True,
    ):
        self.engine = engine
        # name the held prefix pages in Attach so prefill may READ them (--kv-read-held-prefix)
        self.offer_held_prefix = offer_held_prefix
        self.receiver = receiver
        self.coordinator = coordinator
        self.metrics = metrics
        self.faults = faults
        self.jobs: dict[int, Job] = {}
        self._seq = itertools.count()
        self._bg: set[asyncio.Task] = set()
        self.admission = Admission(self, quarantine_max, quarantine_retry, quarantine_unreachable_hold)
        self.scheduler = DecodeScheduler(self, max_running, chunk_budget)
        receiver.on_terminal = self._on_receiver_terminal
        receiver.checksum_memo = engine.prefix_cache  # offered held pages: hashed once while cached
        m = metrics
        m.gauge_from("num_decode_prealloc_queue_reqs", lambda: self._count(Phase.PREALLOC, Phase.ATTACHING))
        m.gauge_from("num_decode_transfer_queue_reqs", lambda: self._count(Phase.AWAITING_KV))
        m.gauge_from("num_running_reqs", lambda: self._count(Phase.RUNNING, Phase.PREFILLING))  # colocated prompts too
        m.gauge_from("num_retracted_reqs", lambda: self._count(Phase.RETRACTED))
        m.pool_gauges(engine.pool)
        watch_prefix_cache(m, engine.prefix_cache)

    # --- queries ---------------------------------------------------------------------------
    def _count(self, *phases: Phase) -> int:
        return sum(1 for j in self.jobs.values() if j.phase in phases)

    def load(self) -> tuple[int, int]:
        """(queued, running): rooms waiting for pages or KV, or retracted; requests in the batch.
        A finished job whose pages wait for a forward or an attach to let go is neither: its
        request is over (the router has its last chunk or failure), and counted it would weigh on
        this worker in the router's choice as someone else's request until the next report."""
        running = self._count(Phase.RUNNING)
        return len(self.jobs) - running - self._count(Phase.FINISHED), running

    def is_computing(self, job: Job) -> bool:
        """Whether a forward is computing this job's next token right now (the servicer sends
        keep-alive chunks for a job that is held but not computing)."""
        return job in self.scheduler.in_forward

    # --- requests --------------------------------------------------------------------------
    def submit(self, room: int, token_ids: list[int], params: SamplingParams, prefill_addr: str,
               canary: bool = False) -> Job:
        """Register a Decode RPC's room (raises DuplicateRoom); it enters the prealloc queue.
        prefill_addr "" : colocated, decode computes the prompt itself (no receiver room)."""
        if room in self.jobs:
            raise DuplicateRoom(f"room {room} already exists")
        job = Job(room, token_ids, params, prefill_addr, next(self._seq), asyncio.Queue(), canary=canary)
        if not job.colocated:
            self.receiver.create_room(room, prefill_addr)
        self.jobs[room] = job
        if not canary:
            self.metrics.inc(self.metrics.num_requests)
        self.admission.wake()
        return job

    def abort(self, room: int, reason: str) -> bool:
        """Abort from the router (RPC cancelled / Abort RPC)."""
        job = self.jobs.get(room)
        if job is None or job.finished:
            return False
        self.metrics.inc(self.metrics.num_aborted_requests)
        self.fail(job, reason, "CANCELLED")
        return True

    def evict(self, room: int, queue: str, age: float, deadline: float) -> None:
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        r = self.receiver.rooms.get(room)
        with bound_room(room):
            log.warning(
                "watchdog eviction", queue=queue, state=r.state.label if r else None,
                age_s=round(age, 3), deadline_s=deadline,
            )
        self.metrics.inc(self.metrics.watchdog_evictions, queue=queue)
        counter = self.metrics.num_bootstrap_failed_reqs if queue == "prealloc" else self.metrics.num_transfer_failed_reqs
        self.metrics.inc(counter)
        self.fail(job, f"watchdog: {age:.1f}s in the {queue} queue exceeds its {deadline:g}s deadline", "DEADLINE_EXCEEDED")

    def fail_stuck_forward(self, reason: str) -> None:
        """The current forward outlived --forward-timeout: fail its requests now. Their pages
        come back when (if) the forward returns."""
        for job in list(self.scheduler.in_forward):
            self.fail(job, reason, "UNAVAILABLE")

    # --- the one way a job ends ---------------------------------------------------------------
    def fail(self, job: Job, reason: str, code: str) -> None:
        self.finish(job, DecodeFailed(reason, code))

    def finish(self, job: Job, failure: DecodeFailed | None = None) -> None:
        """End the job once: a failure is streamed to the RPC (a success's last chunk already
        was); the pages are released unless an attach RPC or a forward still uses them."""
        if job.finished:
            return
        job.ended_in, job.phase = job.phase, Phase.FINISHED
        if failure is not None:
            with bound_room(job.room):
                log.info("decode room failed", reason=failure.reason, code=failure.code)
            job.out.put_nowait(failure)
            if not job.colocated:
                self.receiver.fail(job.room, failure.reason)  # no-op once the KV has arrived
        elif not job.canary:
            self.metrics.observe(self.metrics.e2e_request_latency, time.monotonic() - job.created_at)
        if job not in self.admission.attaching and job not in self.scheduler.in_forward:
            self.release(job)

    def release(self, job: Job) -> None:
        """Exactly once per job: pages back to the pool (or into quarantine while prefill may
        still WRITE into them), the receiver forgets the room, the job leaves the table."""
        if self.jobs.pop(job.room, None) is None:
            return
        if job.params.lora_name:
            self.engine.detach_retired_loras(self.jobs.values())
        if job.pages is not None:
            alloc = self.engine.pool.allocator
            if job.ended_in in PAGES_EXPOSED:
                # prefill may still WRITE into the fresh pages it was named, and READ the held
                # prefix pages it was offered (a recycled page would feed it another prompt's KV):
                # both wait for its quiesced answer; held pages never offered go back at once
                skip = job.cached_tokens // self.engine.pool.page_size
                alloc.free(job.pages[job.offered_pages:skip], owner=job.room)
                self.admission.quarantine(job.room, job.prefill_addr,
                                          job.pages[:job.offered_pages] + job.pages[skip:])
            else:
                self._keep_cached(job)
                alloc.free(job.pages, owner=job.room)
            job.pages = None
        self.receiver.release(job.room)
        self.engine.forget_room(job.room)
        self.pages_freed()

    def _keep_cached(self, job: Job) -> None:
        """Before a job lets go of its pages, the full ones whose KV is complete join the prefix
        cache: a later round of the conversation finds them here. Complete: every token but the
        last of a job that ran (its KV arrived, or was computed, and no WRITE can come any more),
        or what a local prefill computed. A job that ended waiting for KV or retracted has none."""
        cache = self.engine.prefix_cache
        if cache is None:
            return
        if job.ended_in is Phase.RUNNING:
            tokens = job.kv_tokens
        elif job.ended_in is Phase.PREFILLING:
            tokens = job.token_ids[: job.prefilled]
        else:
            return
        cache.insert(tokens, job.pages, len(tokens) // self.engine.pool.page_size,
                     cache.keys(tokens, job.params.cache_salt, job.params.lora_name))

    def reset_prefix_cache(self) -> int:
        """Forget every cached page; pages running jobs hold stay theirs. Returns entries dropped."""
        cache = self.engine.prefix_cache
        if cache is None:
            return 0
        dropped = cache.clear()
        log.info("prefix cache reset", pages=dropped)
        self.pages_freed()
        return dropped

    def pages_freed(self) -> None:
        self.admission.wake()
        if self._count(Phase.RETRACTED):
            self.scheduler.wake()

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # --- KV arrival and tokens ---------------------------------------------------------------
    def _on_receiver_terminal(self, r: ReceiverRoom) -> None:
        asyncio.get_running_loop().call_soon(self._on_kv, r.room, r.state, r.reason, r.result, r.code)

    def _on_kv(self, room: int, state: RoomState, reason: str | None, row, code: str = "UNAVAILABLE") -> None:
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        if state != RoomState.SUCCESS:
            if job.pages is not None:
                self.metrics.inc(self.metrics.num_transfer_failed_reqs)
            if code == "DATA_LOSS":  # the KV checksum failed: wrong KV never reaches a step
                self.metrics.inc(self.metrics.kv_integrity_failures, prefill=job.prefill_addr,
                                 decode=self.metrics.labels["worker"])
                with bound_room(room):
                    log.error("KV checksum failed; the room fails before its first step", reason=reason,
                              prefill=job.prefill_addr, pages=job.pages)
            self.fail(job, reason or "KV transfer failed", code)
            return
        self.admission.freeze_if_injected(job)
        job.phase = Phase.RUNNING
        job.usage_cached_tokens = row.cached_tokens
        self.emit(job, row.token, row.logprob)
        if not job.finished:
            self.scheduler.wake()

    def emit(self, job: Job, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        now = time.monotonic()
        if not job.canary:
            if job.last_token_at is None:
                self.metrics.observe(self.metrics.time_to_first_token, now - job.created_at)
            else:
                self.metrics.observe(self.metrics.inter_token_latency, now - job.last_token_at)
            self.metrics.generated_tokens()
        job.last_token_at = now
        job.output.append(token)
        finish = ""
        if is_stop(token, job.params, self.engine.config.eos_token_ids):
            finish = "stop"
        elif len(job.output) >= job.params.max_tokens:
            finish = "length"
        job.out.put_nowait(Tokens([token], [logprob], finish, len(job.output), [top] if top is not None else []))
        if finish:
            self.finish(job)
