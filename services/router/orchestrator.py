"""One request across the workers: fail over before the first byte, migrate after it.

`Orchestrator.generate()` runs `Attempt`s (services/router/attempt.py) until the request ends:

- **Fail-over.** An attempt that fails before decode's first token — a worker error, a worker
  the pool ejects, a silent stream — is ended at once (its RPCs cancelled, so the workers abort
  the room) and the request runs again on another pair, avoiding the suspects. With no healthy
  pair left the client gets 503 `no_healthy_workers` at once (after one on-the-spot probe of
  the ejected workers, see WorkerPool.choose_pair).
- **Migration.** After decode's first token the client may already hold bytes, so the request
  cannot start over; it continues instead. The router keeps the prompt ids and every id decode
  has sent; when the decode fails, is ejected or stalls, it sends prompt + generated ids to a
  fresh pair with the remaining max_tokens and the same seed. Sampling is keyed by (seed,
  absolute position), so the continuation is exactly what an uninterrupted run would have
  produced; the caller sees one stream of chunks and never learns of the move (usage, stop
  strings, logprobs and detokenization continue in ResponseState). At most `max_migrations`
  per request (0: a failure after the first token ends the request, as before).
- **Capacity.** A worker that refuses the request because it can never hold its KV ("needs
  more KV pages than this worker has", INVALID_ARGUMENT) is skipped and the request tries the
  others; when every healthy worker of that role has refused, the client gets a 400 saying so.

Other INVALID_ARGUMENT refusals are a 400 at once; the request deadline is a 504.
It yields `Chunk`s and raises `APIError`; closing the generator (aclose) cancels the RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc

from services.common.logging_setup import bound_contextvars, get_logger
from services.common.metrics import Metrics
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.router.attempt import Attempt, Chunk, WorkerFailure
from services.router.errors import APIError, bad_request, deadline_exceeded, upstream_failed
from services.router.migration import Progress, migration_reason
from services.router.pair_health import pair_failure
from services.router.pool import Worker, WorkerPool
from services.router.protocol import GenerateSpec

if TYPE_CHECKING:
    from services.router.fanout import PrefillShare

__all__ = ["Chunk", "Orchestrator", "WorkerFailure", "new_room", "sampling_params"]

log = get_logger("router.orchestrator")

DEADLINE_SLACK = 0.05  # an RPC failing this close to the request deadline counts as the deadline
MAX_FAILOVERS = 3  # attempts that failed before producing a token, per request (capacity refusals aside)
CAPACITY_REFUSAL = "needs more KV pages than this worker has"  # the workers' servicers say this


def new_room() -> int:
    """A random, non-zero 63-bit room id (also the request id in logs)."""
    while True:
        room = secrets.randbits(63)
        if room:
            return room


def sampling_params(spec: GenerateSpec, eos_ids: Sequence[int]) -> SamplingParams:
    """The workers' sampling parameters; the eos ids stop decode unless ignore_eos."""
    stop_ids = tuple(dict.fromkeys([*spec.stop_token_ids, *([] if spec.ignore_eos else eos_ids)]))
    return SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,  # always set by protocol.py, so a migrated request samples the same stream
        max_tokens=spec.max_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=spec.ignore_eos,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=spec.logit_bias,
        min_tokens=spec.min_tokens,
        grammar=spec.grammar,
        top_logprobs=spec.logprobs or 0,
        min_p=spec.min_p,
        allowed_token_ids=spec.allowed_token_ids,
        bad_words=spec.bad_words,
    )


def retry_avoids(failure: WorkerFailure, prefill: Worker, decode: Worker) -> set[Worker]:
    """Workers the next attempt should avoid.

    A failure on decode's stream is decode's own (its process or its room): prefill is not
    suspect, and avoiding it would push the retry towards the other prefills, one of which may be
    dead and not yet ejected. A failure reported by prefill may be caused by either side (a KV
    transfer to a broken decode fails on prefill), so both are avoided.
    """
    if failure.worker is decode or prefill is None:
        return {decode}
    return {prefill, decode}


def is_capacity_refusal(failure: WorkerFailure) -> bool:
    return failure.code == grpc.StatusCode.INVALID_ARGUMENT and CAPACITY_REFUSAL in failure.details


class Orchestrator:
    def __init__(self, pool: WorkerPool, eos_ids: Sequence[int], max_migrations: int = 2,
                 stall_timeout: float = 30.0, metrics: Metrics | None = None):
        self.pool = pool
        self.eos_ids = list(eos_ids)
        self.max_migrations = max_migrations
        self.stall_timeout = stall_timeout
        self.metrics = metrics
        self._reapers: set[asyncio.Task] = set()

    def reap(self, task: asyncio.Task, call, deadline: float) -> None:
        async def wait() -> None:
            loop = asyncio.get_running_loop()
            await asyncio.wait((task,), timeout=max(0.0, deadline - loop.time()))
            if not task.done():
                call.cancel()
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved here; the attempt logs its outcome

        reaper = asyncio.ensure_future(wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)

    async def close(self) -> None:
        for t in list(self._reapers):
            t.cancel()
        for t in list(self._reapers):
            with contextlib.suppress(BaseException):
                await t

    def _error(self, failure: WorkerFailure, deadline: float, timeout: float) -> tuple[APIError, bool]:
        """The client-facing error for a failed attempt, and whether another attempt may help."""
        loop = asyncio.get_running_loop()
        if loop.time() >= deadline - DEADLINE_SLACK:
            return deadline_exceeded(timeout), False
        if failure.code == grpc.StatusCode.INVALID_ARGUMENT:
            return bad_request(f"The worker rejected the request: {failure.details}", code="invalid_request"), False
        return upstream_failed(f"{failure.worker.role} {failure.worker.addr}: "
                               f"{failure.code.name if failure.code else failure.kind.upper()}: "
                               f"{failure.details}"), True

    def _check_capacity(self, refused: set[Worker], spec: GenerateSpec, progress: Progress) -> None:
        """400 once every healthy worker of a role has refused the request for capacity."""
        for role, group in (("prefill", self.pool.prefills), ("decode", self.pool.decodes)):
            healthy = [w for w in group if w.healthy]
            if healthy and all(w in refused for w in healthy):
                raise bad_request(
                    f"The request needs more KV cache than any {role} worker has: prompt of "
                    f"{len(progress.ids())} tokens + max_tokens {progress.remaining}. Send a shorter "
                    "prompt or a smaller max_tokens.",
                    param="max_tokens" if spec.max_tokens > len(spec.prompt_ids) else "prompt",
                    code="kv_capacity_exceeded",
                )

    async def generate(
        self, spec: GenerateSpec, deadline: float, timeout: float, first_room: int | None = None,
        share: PrefillShare | None = None,
    ) -> AsyncIterator[Chunk]:
        """Chunks of one request; raises APIError. Close it (aclose) to cancel the RPCs.

        The first attempt uses `first_room` (the request id) when given; later ones get new rooms.
        `share` (one choice of n > 1): the first attempt goes to the prefill the choices share,
        with their share key (services/router/fanout.py).
        """
        loop = asyncio.get_running_loop()
        base = sampling_params(spec, self.eos_ids)
        progress = Progress(list(spec.prompt_ids), spec.max_tokens)
        exclude: set[Worker] = set()
        refused: set[Worker] = set()
        failovers = migrations = number = 0
        failed_pairs: set[tuple[Worker, Worker]] = set()
        repeats = 0  # attempts on a pair that already failed (when nothing else is healthy)
        last_error: APIError | None = None
        attempt: Attempt | None = None
        completed = False
        try:
            while True:
                if loop.time() >= deadline:
                    raise deadline_exceeded(timeout)
                if progress.remaining <= 0:  # every token arrived, only the finish reason was lost
                    completed = True
                    yield Chunk([], [], "length")
                    return
                self._check_capacity(refused, spec, progress)
                sharing = share is not None and number == 0
                pair = await self.pool.choose_pair(exclude, share.prefill if sharing else None)
                prefill, decode = pair
                if sharing and share.prefill is None:
                    share.prefill = prefill  # the first choice to get here picks it for all
                share_key = share.key if sharing and prefill is not None and prefill is share.prefill else 0
                if (prefill, decode) in failed_pairs:
                    # Nothing else is healthy: the same pair gets one more chance, not more.
                    repeats += 1
                    if repeats > 1 and last_error is not None:
                        pair.release()
                        raise last_error
                number += 1
                room = first_room if number == 1 and first_room else new_room()
                ids, params = progress.ids(), params_to_pb(progress.params(base))
                # Not bound around the yields below: the caller may resume this generator from
                # another task, where resetting a context variable set here would fail.
                with bound_contextvars(room=room):
                    try:
                        attempt = Attempt(self.pool, self.reap, pair, room, ids, params, deadline,
                                          self.stall_timeout, share_key)
                    except BaseException:
                        pair.release()
                        raise
                    log.info("attempt", attempt=number, prefill=prefill.addr if prefill else "colocated",
                             decode=decode.addr,
                             prompt_tokens=len(ids), max_tokens=progress.remaining, resumed_at=len(progress.generated))
                try:
                    while True:
                        chunk = await attempt.next()
                        if chunk is None:
                            raise WorkerFailure(decode, None, "decode stream ended without a finish reason",
                                                kind="ended")
                        progress.add(chunk.token_ids)
                        completed = bool(chunk.finish_reason)
                        yield chunk
                        if completed:
                            if prefill is not None and self.pool.pairs.clear(prefill, decode):
                                log.info("worker pair served a request again; mark cleared",
                                         prefill=prefill.addr, decode=decode.addr)
                            return
                except WorkerFailure as failure:
                    attempt.close()
                    self.pool.report_failure(failure.worker, failure.code)
                    produced = attempt.got_first
                    attempt = None
                    if is_capacity_refusal(failure):
                        log.warning("worker cannot hold the request; trying another", room=room, attempt=number,
                                    error=str(failure)[:300])
                        refused.add(failure.worker)
                        exclude.add(failure.worker)
                        continue
                    error, retryable = self._error(failure, deadline, timeout)
                    self._judge_pair(failure, prefill, decode, produced, deadline)
                    if produced:
                        migrations += 1
                        retryable = retryable and migrations <= self.max_migrations
                    else:
                        failovers += 1
                        retryable = retryable and failovers <= MAX_FAILOVERS
                    if not retryable:
                        log.warning("attempt failed", room=room, attempt=number, error=str(failure)[:500],
                                    status=error.status, tokens_sent=len(progress.generated))
                        raise error from None
                    exclude |= retry_avoids(failure, prefill, decode)
                    failed_pairs.add((prefill, decode))
                    last_error = error
                    if produced:
                        self._log_migration(failure, room, number, migrations, progress)
                    else:
                        log.warning("attempt failed; failing over", room=room, attempt=number,
                                    error=str(failure)[:500], tokens_sent=len(progress.generated))
        finally:
            if attempt is not None:
                attempt.close(completed)

    def _judge_pair(self, failure: WorkerFailure, prefill: Worker | None, decode: Worker, produced: bool,
                    deadline: float) -> None:
        """Mark the pair when the attempt's KV path failed while both workers may still be fine;
        if one of them is really gone, its ejection drops the mark again (pool._mark)."""
        at_deadline = asyncio.get_running_loop().time() >= deadline - DEADLINE_SLACK
        if prefill is None or not pair_failure(failure.code, failure.kind, produced, at_deadline):
            return
        if self.pool.pairs.mark(prefill, decode, str(failure)[:200]):
            log.warning("worker pair marked: its KV path failed; routing avoids it while others serve",
                        prefill=prefill.addr, decode=decode.addr, error=str(failure)[:300])
        if self.metrics is not None:
            self.metrics.inc(self.metrics.router_pair_failures, prefill=prefill.addr, decode=decode.addr)

    def _log_migration(self, failure: WorkerFailure, room: int, number: int, migrations: int,
                       progress: Progress) -> None:
        reason = migration_reason(failure)
        if self.metrics is not None:
            self.metrics.inc(self.metrics.router_migrations, reason=reason)
        log.warning("migrating request", reason=reason, room=room, attempt=number, migration=migrations,
                    max_migrations=self.max_migrations, from_decode=failure.worker.addr,
                    generated=len(progress.generated), remaining=progress.remaining, error=str(failure)[:300])
