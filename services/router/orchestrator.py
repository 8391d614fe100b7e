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
- **Capacity.** A worker that refuses the request because it can never hold it (refusal code
  KV_CAPACITY or TOO_LONG, services/common/refusal.py) is skipped and the request tries the
  others; when every healthy worker of that role has refused, the client gets a 400 saying so.

- **Conditional disaggregation.** An attempt whose pair has no prefill in PD mode (the pool
  found its decode holding all but a short tail, services/router/conditional_disagg.py) asks
  decode to compute the tail itself (`path="local"` on the attempt line); after any failed
  attempt, the request's next attempts go PD.

Other INVALID_ARGUMENT refusals are a 400 at once; the request deadline is a 504. Which of these
follows a failure is services/router/recovery_policy.py's decision over the request object's
status (services/router/request_state.py); this module carries it out.
It yields `Chunk`s and raises `APIError`; closing the generator (aclose) cancels the RPCs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.logging_setup import bound_contextvars, get_logger
from services.common.metrics import Metrics
from services.common.random_bits import randbits63
from services.common.sampling_params import FIELDS as SAMPLING_FIELDS
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb
from services.router.attempt import Attempt, Chunk, WorkerFailure
from services.router.errors import APIError, bad_request, deadline_exceeded, upstream_failed
from services.router.leases import PairLease
from services.router.migration import Progress, migration_reason
from services.router.pair_health import pair_failure
from services.router.pool import WorkerHandle, WorkerPool
from services.router.prefix_index import RequestKeys
from services.router.protocol import GenerateSpec
from services.router.recovery_policy import Action, FailureKind, classify, decide, next_status
from services.router.request_state import PrefillShare, RequestState, RetryBudget, Status, Timings

__all__ = ["Chunk", "Orchestrator", "WorkerFailure", "new_room", "sampling_params"]

log = get_logger("router.orchestrator")

DEADLINE_SLACK = 0.05  # an RPC failing this close to the request deadline counts as the deadline
MAX_FAILOVERS = 3  # attempts that failed before producing a token, per request (capacity refusals aside)


def new_room() -> int:
    """A random, non-zero 63-bit room id (also the request id in logs)."""
    while True:
        room = randbits63()
        if room:
            return room


# The SamplingParams fields a GenerateSpec does not hold under the same name, from what it holds:
# the rest are copied by name, so a field declared in SamplingParams and parsed into the spec
# reaches the workers with no line here.
_DERIVED = ("stop_token_ids", "top_logprobs", "prompt_logprobs", "num_generated")
_COPIED = tuple(f.name for f in SAMPLING_FIELDS if f.name not in _DERIVED)
_absent = [n for n in _COPIED if n not in GenerateSpec.__dataclass_fields__]
if _absent:
    raise TypeError(f"SamplingParams fields {_absent} are neither in GenerateSpec nor derived in sampling_params()")


def sampling_params(spec: GenerateSpec, eos_ids: Sequence[int]) -> SamplingParams:
    """The workers' sampling parameters; the eos ids stop decode unless ignore_eos. The seed is
    always set by protocol.py, so a migrated request samples the same stream."""
    stop_ids = tuple(dict.fromkeys([*spec.stop_token_ids, *([] if spec.ignore_eos else eos_ids)]))
    return SamplingParams(
        **{name: getattr(spec, name) for name in _COPIED},
        stop_token_ids=stop_ids,
        top_logprobs=spec.logprobs or 0,
        prompt_logprobs=spec.worker_prompt_logprobs,
    )  # num_generated: 0 on a first attempt; migration.Progress sets it for a continuation


def retry_avoids(failure: WorkerFailure, prefill: WorkerHandle, decode: WorkerHandle) -> set[WorkerHandle]:
    """Workers the next attempt should avoid.

    A failure on decode's stream is decode's own (its process or its room): prefill is not
    suspect, and avoiding it would push the retry towards the other prefills, one of which may be
    dead and not yet ejected. A failure reported by prefill may be caused by either side (a KV
    transfer to a broken decode fails on prefill), so both are avoided. So is a KV integrity
    failure (DATA_LOSS), though decode reports it: the pages were written by prefill and landed
    on decode, and either side may have spoiled them (a misrouted WRITE, corrupt memory).
    """
    if prefill is not None and failure.code == grpc.StatusCode.DATA_LOSS:
        return {prefill, decode}
    if failure.worker is decode or prefill is None:
        return {decode}
    return {prefill, decode}


class Orchestrator:
    def __init__(self, pool: WorkerPool, eos_ids: Sequence[int], max_migrations: int = 2,
                 stall_timeout: float = 30.0, metrics: Metrics | None = None, log_requests: bool = True):
        self.pool = pool
        # --log-requests: each attempt's line; off, only the attempts after a failure are logged
        self.log_requests = log_requests
        self.eos_ids = list(eos_ids)
        self.max_migrations = max_migrations
        self.stall_timeout = stall_timeout
        self.metrics = metrics
        self._reapers: dict[asyncio.Task, asyncio.TimerHandle] = {}  # task → its deadline's timer

    def reap(self, task: asyncio.Future, call, deadline: float) -> None:
        """Leave `task` (the future of an attempt's Prefill reply, still on its way) to end in the
        background, bounded by `deadline`: past it, the call and the future are cancelled. A timer
        and a done callback, not a task of its own: the router's hot path."""
        def expire() -> None:
            self._reapers.pop(task, None)
            if not task.done():
                call.cancel()
                task.cancel()

        def done(_: asyncio.Future) -> None:
            timer = self._reapers.pop(task, None)
            if timer is not None:
                timer.cancel()
            if not task.cancelled():
                task.exception()  # retrieved here; the attempt logs its outcome

        self._reapers[task] = asyncio.get_running_loop().call_at(deadline, expire)
        task.add_done_callback(done)

    async def close(self) -> None:
        """Stop bounding the tasks left to end in the background (the router is closing)."""
        for timer in self._reapers.values():
            timer.cancel()
        self._reapers.clear()

    def _error(self, failure: WorkerFailure, kind: FailureKind, timeout: float) -> APIError:
        """The client-facing error for a failed attempt of this kind."""
        if kind is FailureKind.DEADLINE:
            return deadline_exceeded(timeout)
        if kind is FailureKind.REJECTED:
            return bad_request(f"The worker rejected the request: {failure.details}", code="invalid_request")
        return upstream_failed(f"{failure.worker.role} {failure.worker.addr}: "
                               f"{failure.code.name if failure.code else failure.kind.upper()}: "
                               f"{failure.details}")

    def _check_capacity(self, refused: set[WorkerHandle], spec: GenerateSpec, progress: Progress) -> None:
        """400 once every healthy worker of a role has refused the request for capacity."""
        if not refused:
            return  # the usual request: no worker refused it
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

    def new_request(self, spec: GenerateSpec, first_room: int | None = None,
                    share: PrefillShare | None = None) -> RequestState:
        """One choice's request object, admitted now, with this router's retry budget."""
        return RequestState(spec, RetryBudget(MAX_FAILOVERS, self.max_migrations),
                            Timings(asyncio.get_running_loop().time()), first_room, share)

    async def generate(self, req: RequestState, deadline: float, timeout: float) -> AsyncIterator[Chunk]:
        """Chunks of one request; raises APIError. Close it (aclose) to cancel the RPCs.

        Moves `req` through its statuses (services/router/request_state.py); what follows a
        failed attempt is recovery_policy.decide's. The first attempt uses `req.first_room` (the
        request id) when given; later ones get new rooms. `req.share` (one choice of n > 1): the
        first attempt goes to the prefill the choices share, with their share key
        (services/router/fanout.py).
        """
        loop = asyncio.get_running_loop()
        spec, share, progress = req.spec, req.share, req.progress
        base = sampling_params(spec, self.eos_ids)
        attempt: Attempt | None = None
        held: PairLease | None = None  # a pair chosen but not yet owned by an attempt
        completed = False
        ended = "closed"  # how the request ended, for its state: set where it ends
        # conditional disaggregation (services/router/conditional_disagg.py): not for a choice
        # sharing one prefill (its choices would each compute the prompt), nor for prompt
        # logprobs (decode would compute the whole prompt for them); after any failed attempt the
        # request goes through prefill, the path fail-over and migration were built on
        allow_local = spec.worker_prompt_logprobs is None
        if spec.lora_name:  # its adapter's workers, while any serves it (a restarted one may not yet)
            req.exclude |= self.pool.lacking(spec.lora_name)
        try:
            while True:
                if loop.time() >= deadline:
                    ended = "deadline"
                    raise deadline_exceeded(timeout)
                if progress.remaining <= 0:  # every token arrived, only the finish reason was lost
                    completed = True
                    req.finish(loop.time(), "length")
                    yield Chunk([], [], "length")
                    return
                self._check_capacity(req.refused, spec, progress)
                sharing = req.sharing
                ids = progress.ids()
                # hashed once, for both roles (under the request's cache_salt and adapter, as the workers key it)
                prompt = RequestKeys(ids, base.cache_salt, base.lora_name) if self.pool.cache_aware else None
                held = await self.pool.choose_pair(req.exclude, share.prefill if sharing else None, prompt,
                                                   allow_local=allow_local and not sharing,
                                                   avoid_pairs=req.failed_pairs)
                prefill, decode = held
                path = "colocated" if self.pool.colocated else "local" if prefill is None else "pd"
                if path == "local" and self.metrics is not None:
                    self.metrics.inc(self.metrics.router_local_prefill_requests)
                if sharing and share.prefill is None:
                    share.prefill = prefill  # the first choice to get here picks it for all
                share_key = share.key if sharing and prefill is not None and prefill is share.prefill else 0
                if (prefill, decode) in req.failed_pairs:
                    # Nothing else is healthy: the same pair gets one more chance, not more.
                    req.repeats += 1
                    if req.repeats > 1 and req.last_error is not None:
                        raise req.last_error
                first = req.attempts == 0
                req.attempt_started(loop.time())
                room = req.first_room if first and req.first_room else new_room()
                params = params_to_pb(progress.params(base))
                # Not bound around the yields below: the caller may resume this generator from
                # another task, where resetting a context variable set here would fail.
                with bound_contextvars(room=room):
                    attempt = Attempt(self.pool, self.reap, held, room, ids, params, deadline,
                                      self.stall_timeout, share_key)
                    held = None  # the attempt releases the pair's leases from now on
                    if self.log_requests or not first:
                        log.info("attempt", attempt=req.attempts, prefill=prefill.addr if prefill else path,
                                 decode=decode.addr, path=path, status=req.status.value,
                                 prompt_tokens=len(ids), max_tokens=progress.remaining,
                                 resumed_at=len(progress.generated))
                try:
                    while True:
                        chunk = await attempt.next()
                        if chunk is None:
                            raise WorkerFailure(decode, None, "decode stream ended without a finish reason",
                                                kind="ended")
                        req.tokens(chunk.token_ids, loop.time())
                        completed = bool(chunk.finish_reason)
                        if completed:
                            # before the yield: a consumer that has its last chunk may never resume us
                            req.finish(loop.time(), chunk.finish_reason)
                            if prompt is not None:  # decode keeps prompt + reply cached, but the last id's KV
                                self.pool.remember(decode, prompt.extended(progress.ids()[:-1]))
                            if prefill is not None and self.pool.pairs.clear(prefill, decode):
                                log.info("worker pair served a request again; mark cleared",
                                         prefill=prefill.addr, decode=decode.addr)
                        yield chunk
                        if completed:
                            return
                except WorkerFailure as failure:
                    attempt.close()
                    attempt = None
                    allow_local = False
                    self.pool.report_failure(failure.worker, failure.code)
                    self._recover(req, failure, room, prefill, decode, deadline, timeout)
        except APIError as e:
            ended = e.message
            raise
        finally:
            if attempt is not None:
                attempt.close(completed)
            if held is not None:
                held.release()
            req.finish(loop.time(), error="" if completed else ended)  # a no-op when it ended above

    def _recover(self, req: RequestState, failure: WorkerFailure, room: int, prefill: WorkerHandle | None,
                 decode: WorkerHandle, deadline: float, timeout: float) -> None:
        """Act on a failed attempt as recovery_policy decides: skip the worker, fail over or
        migrate (the request's next status), or raise the client's error."""
        status = req.status
        produced = status is Status.STREAMING  # the client may hold bytes of this attempt
        at_deadline = asyncio.get_running_loop().time() >= deadline - DEADLINE_SLACK
        kind = classify(failure.code, failure.refusal, at_deadline)
        action = decide(status, kind, req.budget.failovers_left, req.budget.migrations_left)
        if action is Action.SKIP_WORKER:
            log.warning("worker cannot hold the request; trying another", room=room, attempt=req.attempts,
                        refusal=failure.refusal.name, error=str(failure)[:300])
            req.refused.add(failure.worker)
            req.exclude.add(failure.worker)
            req.to(next_status(status, action))
            return
        error = self._error(failure, kind, timeout)
        self._judge_pair(failure, prefill, decode, produced, deadline)
        if action is Action.FAIL:
            log.warning("attempt failed", room=room, attempt=req.attempts, error=str(failure)[:500], status=error.status,
                        request_status=status.value, tokens_sent=len(req.progress.generated))
            raise error from None
        if action is Action.MIGRATE:
            req.budget.migrations += 1
        else:
            req.budget.failovers += 1
        req.to(next_status(status, action))
        req.exclude |= retry_avoids(failure, prefill, decode)
        req.failed_pairs.add((prefill, decode))
        req.last_error = error
        if action is Action.MIGRATE:
            self._log_migration(failure, req, room)
        else:
            log.warning("attempt failed; failing over", room=room, attempt=req.attempts, error=str(failure)[:500],
                        request_status=status.value, tokens_sent=len(req.progress.generated))

    def _judge_pair(self, failure: WorkerFailure, prefill: WorkerHandle | None, decode: WorkerHandle, produced: bool,
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

    def _log_migration(self, failure: WorkerFailure, req: RequestState, room: int) -> None:
        reason = migration_reason(failure)
        if self.metrics is not None:
            self.metrics.inc(self.metrics.router_migrations, reason=reason)
        log.warning("migrating request", reason=reason, room=room, attempt=req.attempts, migration=req.budget.migrations,
                    max_migrations=self.max_migrations, from_decode=failure.worker.addr,
                    generated=len(req.progress.generated), remaining=req.progress.remaining,
                    error=str(failure)[:300])
