"""The decode worker's core: jobs, page allocation, attach, the continuous-batching loop.

The asyncio loop owns every job and the KV receiver; forwards run on the engine thread.
A job's life (DESIGN.md §2-§3):

  prealloc (room Bootstrapping: waiting for KV pages, then attaching to prefill)
  -> transfer (WaitingForInput: prefill computing, bounded by its liveness;
               Transferring: prefill said forward done, bounded by --transfer-timeout)
  -> running (KV and first token arrived; joins the decode batch between steps)
  -> finished (stop / length) or failed (any stage)

Pages grow on demand while decoding. Cleanup runs exactly once per job and never while its
pages are inside a running forward.
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
from services.engine.local_generate import is_stop
from services.engine.page_allocator import OutOfPages
from services.engine.runner import DecodeItem
from services.engine.sampling_params import SamplingParams
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
        self._alloc_work.set()

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
        self._alloc_work.set()

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
            waiting = sorted(
                (j for j in self.jobs.values() if j.pages is None and not j.finished), key=lambda j: j.seq
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
                batch = self._pick_batch()
                if not batch:
                    break
                await self._step(batch)

    def _pick_batch(self) -> list[Job]:
        pool = self.engine.pool
        batch = []
        for job in sorted((j for j in self.jobs.values() if j.running and not j.finished), key=lambda j: j.seq):
            if len(batch) >= self.max_running:
                break
            position = len(job.token_ids) + len(job.output) - 1  # the last token goes in here
            if pool.pages_for_tokens(position + 1) > len(job.pages):
                try:
                    job.pages += pool.allocator.alloc(1, owner=job.room)
                except OutOfPages:
                    self._fail(job, "out of KV pages while decoding", "RESOURCE_EXHAUSTED")
                    continue
            batch.append(job)
        return batch

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
