"""The prefill worker's core: jobs, the scheduler loop, and room completion.

The asyncio loop owns every job and the KV sender; the only other thread is the engine thread
that runs forwards. A job's life (DESIGN.md §2-§3):

  bootstrap (room Bootstrapping: waiting for decode's Attach)
  -> waiting (WaitingForInput: attached; scheduled in chunks under the token budget)
  -> inflight (Transferring: first token sampled, KV WRITE posted to decode)
  -> done (Success: the RPC returns) or failed (any stage; the RPC fails)

Cleanup (pages back to the pool, sender room released) runs exactly once per job, and never
while the job's pages are inside a running forward.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from services.common.faults import Faults
from services.common.logging_setup import bound_room, get_logger
from services.common.metrics import Metrics
from services.engine.page_allocator import OutOfPages
from services.engine.runner import PrefillItem
from services.common.sampling_params import SamplingParams
from services.engine.worker_engine import WorkerEngine
from services.transfer.sender import KVSender, SenderRoom
from services.transfer.state import RoomState

log = get_logger("prefill")


class RoomFailed(Exception):
    """The room ended without its KV reaching decode; `reason` says why."""

    def __init__(self, reason: str, deadline_exceeded: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.deadline_exceeded = deadline_exceeded


@dataclass
class PrefillResult:
    first_token: int
    first_logprob: float
    prompt_tokens: int
    kv_bytes: int
    kv_transfer_seconds: float


@dataclass(eq=False)
class Job:
    room: int
    token_ids: list[int]
    params: SamplingParams
    seq: int  # arrival order (FIFO scheduling)
    future: asyncio.Future
    created_at: float = field(default_factory=time.monotonic)
    pages: list[int] | None = None
    prefilled: int = 0
    in_forward: bool = False
    finished: bool = False  # terminal outcome delivered; cleanup pending or done
    deadline_exceeded: bool = False
    first_token: int = -1
    first_logprob: float = 0.0


class PrefillWorker:
    def __init__(
        self,
        engine: WorkerEngine,
        sender: KVSender,
        metrics: Metrics,
        faults: Faults,
        chunk_budget: int,
    ):
        self.engine = engine
        self.sender = sender
        self.metrics = metrics
        self.faults = faults
        self.chunk_budget = chunk_budget
        self.jobs: dict[int, Job] = {}
        self._seq = itertools.count()
        self._work = asyncio.Event()
        sender.on_terminal = self._on_sender_terminal
        sender.on_attached = lambda _room: self.kick()
        m = metrics
        m.gauge_from("num_prefill_bootstrap_queue_reqs", lambda: self.count_state(RoomState.BOOTSTRAPPING))
        m.gauge_from("num_queue_reqs", lambda: sum(1 for j in self._waiting() if not j.in_forward))
        m.gauge_from("num_running_reqs", lambda: sum(1 for j in self.jobs.values() if j.in_forward))
        m.gauge_from("num_prefill_inflight_queue_reqs", lambda: self.count_state(RoomState.TRANSFERRING))
        m.gauge_from("token_usage", lambda: engine.pool.token_usage)

    # --- queries ---------------------------------------------------------------------------
    def count_state(self, state: RoomState) -> int:
        return sum(1 for j in self.jobs.values() if self._state(j) == state)

    def _state(self, job: Job) -> RoomState | None:
        r = self.sender.rooms.get(job.room)
        return r.state if r is not None else None

    def load(self) -> tuple[int, int]:
        """(queued, running): bootstrap + waiting rooms; rooms in a forward or inflight."""
        in_forward = sum(1 for j in self.jobs.values() if j.in_forward)
        queued = self.count_state(RoomState.BOOTSTRAPPING) + self.count_state(RoomState.WAITING_FOR_INPUT) - in_forward
        return queued, in_forward + self.count_state(RoomState.TRANSFERRING)

    def _waiting(self) -> list[Job]:
        return [j for j in self.jobs.values() if self._state(j) == RoomState.WAITING_FOR_INPUT and not j.finished]

    # --- requests --------------------------------------------------------------------------
    def submit(self, room: int, token_ids: list[int], params: SamplingParams) -> Job:
        """Register a Prefill RPC's room (raises DuplicateRoom). Attach may already be parked."""
        job = Job(room, token_ids, params, next(self._seq), asyncio.get_running_loop().create_future())
        self.sender.create_room(room)
        self.jobs[room] = job
        self.metrics.inc(self.metrics.num_requests)
        self.metrics.inc(self.metrics.prompt_tokens, len(token_ids))
        self.kick()
        return job

    def abort(self, room: int, reason: str) -> bool:
        """Abort from the router (RPC cancelled / Abort RPC) or from decode. Exactly-once."""
        known = room in self.jobs
        self.sender.abort(room, reason)
        if known:
            self.metrics.inc(self.metrics.num_aborted_requests)
        return known

    def evict(self, room: int, queue: str, age: float, deadline: float) -> None:
        """The watchdog's verdict on one entry."""
        job = self.jobs.get(room)
        if job is None:
            return
        state = self._state(job)
        job.deadline_exceeded = True
        with bound_room(room):
            log.warning(
                "watchdog eviction", queue=queue, state=state.label if state else None,
                age_s=round(age, 3), deadline_s=deadline,
            )
        self.metrics.inc(self.metrics.watchdog_evictions, queue=queue)
        if queue == "bootstrap":
            self.metrics.inc(self.metrics.num_bootstrap_failed_reqs)
        self.sender.fail(room, f"watchdog: {age:.1f}s in the {queue} queue exceeds its {deadline:g}s deadline")

    def kick(self) -> None:
        self._work.set()

    # --- completion ------------------------------------------------------------------------
    def _on_sender_terminal(self, r: SenderRoom) -> None:
        # Called from inside the sender: only schedule, act on the loop's next turn.
        asyncio.get_running_loop().call_soon(self._complete, r.room, r.state, r.reason, r)

    def _complete(self, room: int, state: RoomState, reason: str | None, r: SenderRoom) -> None:
        job = self.jobs.get(room)
        if job is None or job.finished:
            return
        job.finished = True
        if not job.future.done():
            if state == RoomState.SUCCESS:
                seconds = (r.done_at or time.monotonic()) - (r.posted_at or time.monotonic())
                self.metrics.observe(self.metrics.kv_transfer_latency, seconds)
                self.metrics.observe(self.metrics.kv_transfer_bytes, r.nbytes)
                job.future.set_result(
                    PrefillResult(job.first_token, job.first_logprob, len(job.token_ids), r.nbytes, seconds)
                )
            else:
                if job.prefilled == len(job.token_ids) and not job.deadline_exceeded:
                    self.metrics.inc(self.metrics.num_transfer_failed_reqs)
                job.future.set_exception(RoomFailed(reason or "failed", job.deadline_exceeded))
        if not job.in_forward:
            self._cleanup(job)
        self.kick()  # freed pages may unblock waiting jobs

    def _cleanup(self, job: Job) -> None:
        """Exactly once per job: pages back to the pool, the sender forgets the room."""
        if self.jobs.pop(job.room, None) is None:
            return
        if job.pages is not None:
            self.engine.pool.allocator.free(job.pages, owner=job.room)
            job.pages = None
        self.sender.release(job.room)

    # --- scheduling ------------------------------------------------------------------------
    async def schedule_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while True:
                batch = self._pick_batch()
                if not batch:
                    break
                await self._run_batch(batch)

    def _pick_batch(self) -> list[tuple[Job, int]]:
        budget, batch = self.chunk_budget, []
        for job in sorted(self._waiting(), key=lambda j: j.seq):
            if budget <= 0:
                break
            if job.in_forward:
                continue
            if job.pages is None:
                try:
                    need = self.engine.pool.pages_for_tokens(len(job.token_ids))
                    job.pages = self.engine.pool.allocator.alloc(need, owner=job.room)
                except OutOfPages:
                    break  # FIFO: wait for pages to come back rather than starve the head
            n = min(budget, len(job.token_ids) - job.prefilled)
            batch.append((job, n))
            budget -= n
        return batch

    async def _run_batch(self, batch: list[tuple[Job, int]]) -> None:
        items = [PrefillItem(j.token_ids[j.prefilled : j.prefilled + n], j.prefilled, j.pages) for j, n in batch]
        finals = [i for i, (j, n) in enumerate(batch) if j.prefilled + n == len(j.token_ids)]
        params = [batch[i][0].params for i in finals]
        positions = [len(batch[i][0].token_ids) for i in finals]
        delay = self.faults.delay_forward
        engine = self.engine

        def forward():
            if delay:
                time.sleep(delay)  # fault injection: a slow forward (engine thread only)
            logits = engine.runner.prefill(items)
            return engine.sampler.sample(logits[finals], params, positions) if finals else ([], [])

        for j, _ in batch:
            j.in_forward = True
        try:
            tokens, logprobs = await engine.run(forward)
        except Exception as e:  # noqa: BLE001 - a failed forward fails its rooms, not the worker
            log.exception("prefill forward failed", rooms=[j.room for j, _ in batch])
            for j, _ in batch:
                j.in_forward = False
                self.sender.fail(j.room, f"forward failed: {type(e).__name__}: {e}")
            return
        sampled = dict(zip(finals, zip(tokens, logprobs, strict=True), strict=True))
        for i, (job, n) in enumerate(batch):
            job.in_forward = False
            if job.finished or self._state(job) != RoomState.WAITING_FOR_INPUT:
                if job.finished:  # aborted or evicted mid-forward: its cleanup waited for us
                    self._cleanup(job)
                continue
            job.prefilled += n
            if i in sampled:
                job.first_token, job.first_logprob = sampled[i]
                self.sender.send(job.room, job.pages, job.first_token, job.first_logprob)
