"""Decode admission: KV pages for new rooms, the Attach to prefill, and quarantine.

A room is admitted in order — vLLM's priority, then arrival — once pages for its prompt (+1
token) are free; retracted requests come first (they were admitted earlier and hold their place
in the batch), so admission waits while any is retracted and is woken again when the last one
resumes. Admission then attaches the room
to its prefill (decode's page ids travel in the Attach) and the job waits for its KV. A
colocated job (no prefill) goes to PREFILLING instead: the scheduler computes its prompt.

Late writes: once an Attach may have reached prefill, prefill can WRITE into those pages until it
lets go of the room, so the pages of a room that ends before its KV arrived are quarantined —
held back from the pool — until prefill confirms it let go or is gone (services/decode/quarantine.py).

Prefix cache (--prefix-cache): a room first takes the longest cached prefix of its prompt
(pages shared with the cache and other rooms, full pages only, at least one prompt token left)
and fresh pages for the rest. The Attach names only the fresh pages as destinations
(`skip_pages` says how many prompt pages decode holds), so prefill sends only those and no WRITE
can reach a shared page. With --kv-read-held-prefix it also offers the held pages' ids (and a KV
checksum each) for prefill to READ what its own cache lacks; a room that ends before its KV
arrived then quarantines those shared pages with the fresh ones, so that no page prefill may
still be reading is evicted and rewritten meanwhile. A colocated room computes from the end of its hit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from services.common.logging_setup import get_logger
from services.decode.jobs import Job, Phase
from services.decode.quarantine import Quarantine
from services.engine.page_allocator import OutOfPages
from services.engine.prefix_cache_metrics import count_lookup

log = get_logger("decode.admission")


class Admission:
    def __init__(self, worker, quarantine_max: float, quarantine_retry: float, unreachable_hold: float = 0.0):
        self.worker = worker  # services.decode.worker.DecodeWorker
        self.pool = worker.engine.pool
        self.coordinator = worker.coordinator
        self.attaching: set[Job] = set()  # jobs whose Attach RPC is in flight
        self._quarantine = Quarantine(self.coordinator, self.pool.allocator, worker.pages_freed,
                                      max_wait=quarantine_max, retry=quarantine_retry,
                                      unreachable_hold=unreachable_hold)
        self._work = asyncio.Event()
        self._froze_once = False

    def wake(self) -> None:
        self._work.set()

    @property
    def pages_quarantined(self) -> int:
        return self._quarantine.pages_held()

    @property
    def has_quarantine(self) -> bool:
        return bool(self._quarantine)

    async def close(self) -> None:
        await self._quarantine.close()

    async def loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            self.admit()

    def admit(self) -> None:
        jobs = self.worker.jobs.values()
        if any(j.phase is Phase.RETRACTED for j in jobs):
            return  # retracted requests get freed pages first; their resume wakes us again
        for job in sorted((j for j in jobs if j.phase is Phase.PREALLOC), key=lambda j: j.order):
            try:
                self._take_pages(job)
            except OutOfPages:
                return  # FIFO: the head waits for pages (bounded by --prealloc-timeout)
            self.worker.metrics.observe(self.worker.metrics.queue_time, time.monotonic() - job.created_at)
            if job.colocated:
                job.prefilled = job.usage_cached_tokens = job.cached_tokens
                job.phase = Phase.PREFILLING
                self.worker.scheduler.wake()
                continue
            job.phase = Phase.ATTACHING
            self.attaching.add(job)
            self.worker.spawn(self._attach(job))

    def _take_pages(self, job: Job) -> None:
        """Prompt KV plus room for the first decode step (more pages come on demand): first the
        prompt's longest cached prefix (shared, read only), then fresh pages, into which alone
        prefill writes. Raises OutOfPages with nothing taken."""
        cache, alloc = self.worker.engine.prefix_cache, self.pool.allocator
        # a colocated job asking for prompt logprobs computes its whole prompt (their logits are
        # not cached: services/engine/prompt_logprobs.py); with a prefill worker prefill computes them
        reads_cache = cache is not None and not (job.colocated and job.params.prompt_logprobs is not None)
        hit = (cache.acquire(job.token_ids, job.room, keys=cache.keys(job.token_ids, job.params.cache_salt, job.params.lora_name))
               if reads_cache else [])
        try:
            fresh = alloc.alloc(self.pool.pages_for_tokens(len(job.token_ids) + 1) - len(hit), owner=job.room)
        except OutOfPages:
            alloc.free(hit, owner=job.room)
            raise
        job.pages = hit + fresh
        job.cached_tokens = len(hit) * self.pool.page_size
        if reads_cache:
            count_lookup(self.worker.metrics, cache, len(job.token_ids), job.cached_tokens)

    async def _attach(self, job: Job) -> None:
        skip = job.cached_tokens // self.pool.page_size
        # only the fresh pages are named as destinations: a WRITE can never reach a shared page;
        # the shared ones may be offered for prefill to READ (a READ never writes decode's memory)
        prompt_pages = job.pages[skip : self.pool.pages_for_tokens(len(job.token_ids))]
        job.offered_pages = skip if self.worker.offer_held_prefix else 0
        try:
            ok = await self.coordinator.attach(job.room, job.prefill_addr, prompt_pages, skip,
                                               job.pages[: job.offered_pages])
        finally:
            self.attaching.discard(job)
        if job.finished:  # failed (abort, watchdog) while the attach RPC was in flight
            self.worker.release(job)
            return
        if not ok:
            r = self.worker.receiver.rooms.get(job.room)
            self.worker.metrics.inc(self.worker.metrics.num_bootstrap_failed_reqs)
            self.worker.fail(job, (r.reason if r else None) or "attach failed", "UNAVAILABLE")
            return
        if job.phase is Phase.ATTACHING:  # the KV may already have arrived (RUNNING)
            job.phase = Phase.AWAITING_KV
        self.freeze_if_injected(job)

    def freeze_if_injected(self, job: Job) -> None:
        """The sigstop_after_*attach faults: freeze once, after an attach has gone out. Called when
        the Attach reply is handled and again when the KV arrives, because on a busy box the KV
        (a cached prompt needs almost no prefill) can arrive and the job finish before the reply
        is handled; checking only there let such a request succeed with the fault never fired."""
        f = self.worker.faults
        if (f.sigstop_after_attach or (f.sigstop_after_held_attach and job.offered_pages)) and not self._froze_once:
            self._froze_once = True
            log.warning("FAULT INJECTION: freezing this process (SIGSTOP) right after attach", room=job.room)
            os.kill(os.getpid(), signal.SIGSTOP)

    # --- quarantine --------------------------------------------------------------------------
    def quarantine(self, room: int, prefill_addr: str, pages: list[int]) -> None:
        self._quarantine.hold(room, prefill_addr, pages)
