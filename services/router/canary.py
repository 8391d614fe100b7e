"""The canary: a one-token request through the whole path of each idle (prefill, decode) pair.

A worker's health probe cannot see whether that prefill can move KV to that decode. The canary
can, because it takes the real path: a Prefill RPC and a Decode stream as a user's request
would (decode allocates pages and attaches, prefill computes, the KV moves over NIXL and the
first token arrives through the aux row), with `max_tokens` 1 and a deadline of
`--canary-timeout`.

- A pair gets a canary when no request used it for `--canary-interval` seconds and none was
  sent to it for as long; a marked pair (services/router/pair_health.py) gets one every interval,
  so a healed pair is cleared within one interval.
- A canary that fails or outlives its timeout marks the pair; one that passes clears it.
- Canaries never show in the router's client metrics or request logs; they count in
  `pdmesh:canary_requests_total{prefill,decode,result}` and `pdmesh:canary_latency_seconds`, and
  the workers leave them out of their request metrics (the `canary` field of the calls).
- Each router process runs its own canaries and keeps its own marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog

from services.common.logging_setup import get_logger
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.router.attempt import Attempt, WorkerFailure
from services.router.leases import PairLease
from services.router.pool import WorkerHandle, WorkerPool

log = get_logger("router.canary")


class Canary:
    def __init__(self, pool: WorkerPool, reap: Callable, prompt_ids: Sequence[int], interval: float,
                 timeout: float, metrics: Metrics | None = None, new_room: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.reap = pool, reap
        self.prompt_ids = list(prompt_ids)
        self.interval, self.timeout = interval, timeout
        self.metrics = metrics
        self.clock = clock
        self._new_room = new_room
        self._started = clock()
        self._last_sent: dict[tuple[WorkerHandle, WorkerHandle], float] = {}
        self._running: dict[tuple[WorkerHandle, WorkerHandle], asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self.params = params_to_pb(SamplingParams(temperature=0.0, max_tokens=1, seed=0, ignore_eos=True))

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="router-canary")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    def due(self) -> list[tuple[WorkerHandle, WorkerHandle]]:
        """The healthy pairs that need a canary now."""
        now = self.clock()
        out = []
        for p in self.pool.prefills:
            for d in self.pool.decodes:
                pair = (p, d)
                if not (p.healthy and d.healthy) or pair in self._running:
                    continue
                since_sent = now - self._last_sent.get(pair, self._started)
                idle = self.pool.pairs.idle_for(p, d, self._started)
                if since_sent >= self.interval and (idle >= self.interval or self.pool.pairs.is_marked(p, d)):
                    out.append(pair)
        return out

    async def _loop(self) -> None:
        tick = min(1.0, max(0.05, self.interval / 4))
        while True:
            await asyncio.sleep(tick)
            try:
                for pair in self.due():
                    self._last_sent[pair] = self.clock()
                    task = asyncio.create_task(self.probe(*pair), name="router-canary-probe")
                    self._running[pair] = task
                    task.add_done_callback(lambda _t, pair=pair: self._running.pop(pair, None))
                live = {(p, d) for p in self.pool.prefills for d in self.pool.decodes}
                for pair in [k for k in self._last_sent if k not in live]:
                    del self._last_sent[pair]  # a worker left the pool
            except Exception as e:  # noqa: BLE001 - the canary loop must never die
                log.error("canary loop error", error=repr(e))

    async def probe(self, prefill: WorkerHandle, decode: WorkerHandle) -> bool:
        """One canary on the pair; marks or clears it. True when it passed."""
        structlog.contextvars.clear_contextvars()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.timeout
        room = self._new_room() if self._new_room else 0
        # held like a request's: released by the attempt, and again (a no-op then) below
        pair = PairLease(prefill, decode, self.pool.reserve(prefill), self.pool.reserve(decode))
        attempt = None
        error = ""
        try:
            attempt = Attempt(self.pool, self.reap, pair, room, self.prompt_ids, self.params,
                              deadline, self.timeout, canary=True)
            async with asyncio.timeout(self.timeout):
                while True:
                    chunk = await attempt.next()
                    if chunk is None:
                        error = "decode stream ended without a finish reason"
                        break
                    if chunk.finish_reason:
                        break
        except TimeoutError:
            error = f"no answer within {self.timeout:g} s"
        except WorkerFailure as failure:
            error = str(failure)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the pair did not serve
            error = repr(e)
        finally:
            if attempt is None:
                pair.release()
            else:
                attempt.close(completed=not error)
        passed = not error
        self._count(prefill, decode, passed, loop.time() - t0)
        if passed:
            if self.pool.pairs.clear(prefill, decode):
                log.info("canary passed; worker pair cleared", prefill=prefill.addr, decode=decode.addr)
        elif prefill.healthy and decode.healthy:
            if self.pool.pairs.mark(prefill, decode, f"canary: {error[:200]}"):
                log.warning("canary failed; worker pair marked", prefill=prefill.addr, decode=decode.addr,
                            error=error[:300])
        return passed

    def _count(self, prefill: WorkerHandle, decode: WorkerHandle, passed: bool, seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.inc(self.metrics.canary_requests, prefill=prefill.addr, decode=decode.addr,
                         result="pass" if passed else "fail")
        if passed:
            self.metrics.observe(self.metrics.canary_latency, seconds)
