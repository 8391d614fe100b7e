"""The router's workers: one gRPC channel each, active health checks, ejection and re-admission.

- Every `interval` seconds each worker gets a standard `grpc.health.v1.Health/Check` (service
  "") bounded by `timeout`. `failure_threshold` failures in a row eject it; one success
  re-admits it. A worker starts ejected and is admitted by its first good probe (the router
  probes all workers once before it starts serving).
- A request that fails on a worker with UNAVAILABLE asks for an immediate probe; if that probe
  fails too, the worker is ejected at once instead of after the threshold (a killed worker
  leaves the rotation within one probe, not `threshold * interval`).
- After each good probe the worker's `Load` RPC reports its queue depths. A worker's load for
  the policies is this router's own in-flight count on it (exact and current) plus the part of
  the reported depth that is not ours: requests from other routers or clients, as of the last
  probe.
- The router's other processes (`--processes N`) are seen through the load view
  (services/router/load_view.py, chosen once at start): `share` publishes our counts and reads
  theirs, which join each worker's load; a worker one of them ejected is probed at once. With
  one process the view has nobody to share with, and the pool reads the same.
- Each worker's calls go through its transport (services/router/transport.py: its lane, or one
  gRPC call each), made once when the pool meets the worker.
- Addresses come from services/router/discovery.py: a name (e.g. a Kubernetes headless
  Service) stands for every address it resolves to, re-resolved every `dns_refresh_interval`;
  new addresses join (after their first good probe), vanished ones leave the rotation and their
  channel closes once no request of ours runs on it. A name that fails to resolve keeps the
  workers it had.
- When a request finds no healthy worker of a role, the ejected ones are probed once on the
  spot (bounded by `timeout`) before the router answers 503, so a worker that just came back
  (restarted, or SIGCONT after a freeze) serves the very next request.
- Attempts subscribe to ejections (`watch`): the moment the pool ejects a worker, every attempt
  running on it hears of it and ends, instead of waiting on a worker known to be unhealthy.
- Beside each worker's health, `pairs` keeps a mark per (prefill, decode) pair whose KV path
  failed while both workers stayed healthy (services/router/pair_health.py): `choose_pair`
  avoids marked pairs while an unmarked healthy one exists, so a prefill that cannot reach one
  decode keeps serving through the others. A worker's marks go when it is ejected, admitted
  again or leaves the pool.
- `index` is the router's view of what each worker's prefix cache holds
  (services/router/prefix_index.py), which the cache_aware policy reads. Each Load reply carries
  the worker's epoch (new at every start) and its prefix cache's page size: a new epoch means
  an empty cache, so the worker's entries go at once, even when no request failed; an ejected
  or retired worker's entries go too.
- Conditional disaggregation (`local_prefill_max_tokens`, PD + cache_aware only): when the
  decode the policy picks holds all but a short tail of the prompt, `choose_pair` returns
  (None, decode) for a request that allows it, and decode computes the tail itself
  (services/router/conditional_disagg.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
from services.common.logging_setup import get_logger
from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION, incompatibility
from services.common.metrics import Metrics
from services.router.conditional_disagg import goes_local
from services.router.discovery import Resolver, resolve_specs, split_host_port, system_resolver
from services.router.errors import no_healthy_workers
from services.router.leases import Lease, Ledger, PairLease
from services.router.load_view import LOCAL, LoadView
from services.router.pair_health import PairHealth
from services.router.policy import CacheThresholds, make_policy
from services.router.prefix_index import PrefixIndex, RequestKeys
from services.router.shared_state import PeerView, worker_key
from services.router.transport import KEEPALIVE, WorkerTransport, connect

log = get_logger("router.pool")

NO_PEERS = PeerView()


@dataclass(eq=False)
class WorkerHandle:
    """The router's handle on one worker process: where it is, what the router last learned of
    its health and load, and its calls. The processes themselves are services/prefill/worker.py
    and services/decode/worker.py."""

    role: str  # "prefill" | "decode"
    addr: str  # resolved host:port (what decode is told to attach to)
    spec: str = ""  # the --prefill/--decode value it came from
    healthy: bool = False
    failures: int = 0  # failed probes in a row
    inflight: int = 0  # RPCs of this router process in flight on the worker
    peer_inflight: int = 0  # the router's other processes' requests on it (load_view.py; 0 with one process)
    ejections: int = 0  # times this process ejected it (published, so the other processes probe it at once)
    peer_ejections: int = 0  # the other processes' ejections of it, as last read
    external_load: int = 0  # queued + running on the worker that are not ours (last Load report)
    # the most of ours in flight there since the Load call now out began (None: no call out); a
    # report counts ours as of some moment in that call, so what it holds above this is not ours
    inflight_peak: int | None = None
    capacity_tokens: int = 0  # tokens its KV pool holds (last Load report; 0: not reported)
    max_model_len: int = 0  # its --max-model-len (last Load report; 0: not reported)
    chosen_turn: int = 0  # the pool's count of pairs chosen when this prefill was last in one
    epoch: int = 0  # its start's id (last Load report; 0: not reported yet); a new one: it restarted
    prefix_page_size: int = 0  # tokens per page its prefix cache keys (last Load report; 0: no cache)
    lora_adapters: frozenset[str] | None = None  # the LoRA adapters it serves (last Load report; None: none yet)
    last_error: str = ""
    incompatible: str = ""  # why its protocol version does not fit this router's ("" when it does)
    last_change: float = field(default_factory=time.time)
    transport: WorkerTransport | None = None  # its calls: over its lane or one RPC each (transport.py)

    def __post_init__(self) -> None:
        self.key = worker_key(self.role, self.addr)  # its entry in the load view of the router's processes

    def __repr__(self) -> str:
        return f"{self.role}:{self.addr}"

    def _count_inflight(self, delta: int) -> None:
        # the one place the count changes: a Lease (WorkerPool.reserve) takes and gives it back
        self.inflight += delta
        if self.inflight_peak is not None and self.inflight > self.inflight_peak:
            self.inflight_peak = self.inflight


def load_of(w: WorkerHandle) -> int:
    """What the policies compare: our requests on the worker plus everyone else's."""
    return w.inflight + w.peer_inflight + w.external_load


def _least_loaded_then_longest_unchosen(w: WorkerHandle) -> tuple[int, int]:
    return load_of(w), w.chosen_turn


@dataclass
class PrefixMatch:
    """One request's prompt as the cache_aware policy sees it (policy.PrefixView)."""

    index: PrefixIndex
    keys: RequestKeys

    @property
    def total(self) -> int:
        return len(self.keys)

    def matched(self, w: WorkerHandle) -> int:
        size = w.prefix_page_size
        if not size:
            return 0
        # a worker leaves at least one prompt token to compute (prefix_cache.max_hit_pages)
        pages = min(self.index.match(w, self.keys.for_page_size(size)), max(0, self.total - 1) // size)
        return pages * size


class WorkerPool:
    def __init__(
        self,
        prefill_addrs: Iterable[str],
        decode_addrs: Iterable[str],
        policy: str = "round_robin",
        metrics: Metrics | None = None,
        interval: float = 1.0,
        timeout: float = 1.0,
        failure_threshold: int = 2,
        dns_refresh_interval: float = 5.0,
        resolver: Resolver = system_resolver,
        colocated: bool = False,
        lane: bool = True,
        lane_client: str = "h2",
        keepalive: tuple[float, float] = KEEPALIVE,
        load: LoadView = LOCAL,
        pair_hold: float = 30.0,
        cache_thresholds: CacheThresholds | None = None,
        prefix_index_max_pages: int = 65536,
        local_prefill_max_tokens: int = 0,
    ):
        self.pairs = PairHealth(hold=pair_hold)  # (prefill, decode) pairs whose KV path failed
        self.load = load  # the router's other processes' loads and ejections (services/router/load_view.py)
        self.lane = lane  # Prefill / Decode over each worker's lane (services/router/lane.py)
        self.lane_client = lane_client  # what carries it: h2 (services/router/h2_stream.py) or grpc
        self.keepalive = keepalive  # (time, timeout) in seconds, on each worker's connections
        self.colocated = colocated  # decode workers only: choose_pair returns (None, decode)
        self.specs = {"prefill": list(dict.fromkeys(prefill_addrs)), "decode": list(dict.fromkeys(decode_addrs))}
        for spec in (*self.specs["prefill"], *self.specs["decode"]):
            split_host_port(spec)  # a malformed address fails at start, not at the first request
        self.prefills: list[WorkerHandle] = []
        self.decodes: list[WorkerHandle] = []
        self._retired: list[WorkerHandle] = []  # left the rotation; channel closes when idle
        self.dns_refresh_interval = dns_refresh_interval
        self._resolver = resolver
        self._policies = {"prefill": make_policy(policy, thresholds=cache_thresholds),
                          "decode": make_policy(policy, thresholds=cache_thresholds)}
        self.cache_aware = policy == "cache_aware"  # only that policy reads (and so needs) the index
        self.index = PrefixIndex(prefix_index_max_pages)
        self._turn = 0  # pairs chosen with a prefill so far (WorkerHandle.chosen_turn)
        # PD + cache_aware: a request whose decode holds all but this many prompt tokens skips
        # prefill (services/router/conditional_disagg.py; 0: never)
        self.local_prefill_max_tokens = local_prefill_max_tokens if self.cache_aware and not colocated else 0
        self.metrics = metrics
        self.interval = interval
        self.timeout = timeout
        self.failure_threshold = max(1, failure_threshold)
        self._task: asyncio.Task | None = None
        self._probing: dict[WorkerHandle, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        # called with a worker after each of its Load reports (the runtime LoRA adapters'
        # reconciliation, services/router/lora_updates.py); None: nothing to do
        self.on_load_report: Callable[[WorkerHandle], None] | None = None
        self._watchers: set[Callable[[WorkerHandle], None]] = set()
        self.leases = Ledger()  # the in-flight counts handed out by reserve() and not yet released

    @property
    def workers(self) -> list[WorkerHandle]:
        return [*self.prefills, *self.decodes]

    def lacking(self, lora: str) -> set[WorkerHandle]:
        """The workers whose last Load report did not list the LoRA adapter `lora`: a request of
        it avoids them while another worker serves it (choose_pair's `exclude`)."""
        return {w for w in self.workers if w.lora_adapters is not None and lora not in w.lora_adapters}

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # first: with --processes its heartbeat tells the supervisor this loop runs, however long
        # resolving and probing the workers take (with one process it returns at once)
        self._background.add(asyncio.create_task(self.load.run(self.share), name="router-share"))
        await self.refresh_addresses()
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="router-health")

    def _connect(self, w: WorkerHandle) -> WorkerHandle:
        w.transport = connect(w.role, w.addr, self.lane, self.lane_client, self.keepalive,
                              on_failure=lambda code, w=w: self.report_failure(w, code))
        self._set_gauge(w)
        return w

    async def refresh_addresses(self) -> None:
        """Resolve the specs again; add new addresses, retire vanished ones."""
        for role, group in (("prefill", self.prefills), ("decode", self.decodes)):
            found, failed = await resolve_specs(self.specs[role], self._resolver)
            if failed:
                log.warning("worker address does not resolve; keeping its known workers", role=role, specs=failed)
            current = {w.addr: w for w in group}
            keep = [current.get(addr) or self._connect(WorkerHandle(role, addr, spec=spec)) for addr, spec in found]
            keep += [w for w in group if w.spec in failed and w not in keep]
            for w in group:
                if w not in keep:
                    log.info("worker left the pool (its address no longer resolves)", role=role, target=w.addr)
                    self._retire(w)
            for w in keep:
                if w.addr not in current:
                    log.info("worker joined the pool", role=role, target=w.addr, spec=w.spec)
            group[:] = keep
        for w in [w for w in self._retired if w.inflight == 0]:
            self._retired.remove(w)
            self.load.retire(w)  # no longer published: leave it at rest
            await self._disconnect(w)

    def _retire(self, w: WorkerHandle) -> None:
        w.healthy = False
        self.pairs.forget(w)
        self.index.forget(w)
        self._retired.append(w)
        if self.metrics is not None:
            self.metrics.worker_healthy.remove(*self.metrics.labels.values(), w.addr)

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._probing.values(), *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        for w in [*self.workers, *self._retired]:
            await self._disconnect(w)

    @staticmethod
    async def _disconnect(w: WorkerHandle) -> None:
        if w.transport is not None:
            await w.transport.close()

    async def _loop(self) -> None:
        next_resolve = time.monotonic() + self.dns_refresh_interval
        while True:
            await asyncio.sleep(self.interval)
            try:
                if time.monotonic() >= next_resolve:
                    next_resolve = time.monotonic() + self.dns_refresh_interval
                    await self.refresh_addresses()
                await self.probe_all()
            except Exception as e:  # noqa: BLE001 - the health loop must never die
                log.error("health loop error", error=repr(e))

    def share(self) -> None:
        """Publish our per-worker counts and read the other processes': their in-flight requests
        join each worker's load, and a worker one of them ejected is probed here at once (and
        ejected if that probe fails), so a dead or frozen worker leaves every process's rotation
        about as fast as it leaves the first one's."""
        peers = self.load.exchange((*self.workers, *self._retired))
        for w in self.workers:
            view = peers.get(w.key, NO_PEERS)
            w.peer_inflight = view.inflight
            if view.ejections > w.peer_ejections:
                self.confirm(w, "another router process ejected it")
            w.peer_ejections = view.ejections  # also when it fell: a restarted process starts from zero

    # --- probing -------------------------------------------------------------------------------

    async def probe_all(self, workers: Iterable[WorkerHandle] | None = None, fresh: bool = False) -> None:
        await asyncio.gather(*(self.probe(w, fresh) for w in (self.workers if workers is None else workers)))

    async def probe(self, worker: WorkerHandle, fresh: bool = False) -> bool:
        """One probe of `worker` (True if it serves); concurrent callers share a probe in flight.
        `fresh`: the answer must come from a probe begun after this call — one already in flight
        may have been answered before the worker came back — so a failed shared probe is followed
        by one more (shared again, so a wave of requests in an outage probes at most twice)."""
        task = self._probing.get(worker)
        shared = task is not None
        if task is None:
            task = self._start_probe(worker)
        ok = await asyncio.shield(task)
        if ok or not (fresh and shared):
            return ok
        return await asyncio.shield(self._probing.get(worker) or self._start_probe(worker))

    def _start_probe(self, worker: WorkerHandle) -> asyncio.Future:
        task = asyncio.ensure_future(self._probe(worker))
        self._probing[worker] = task

        def forget(done: asyncio.Future) -> None:
            if self._probing.get(worker) is done:  # not a later probe that took its place
                del self._probing[worker]

        task.add_done_callback(forget)
        return task

    async def _probe(self, w: WorkerHandle) -> bool:
        # this task's context was copied from whichever request asked first; the probe is not its
        structlog.contextvars.unbind_contextvars("room", "request_id")
        try:
            reply = await w.transport.health(self.timeout)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            error = "" if ok else f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        except grpc.aio.AioRpcError as e:
            ok, error = False, f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - any failure of the probe is a failed probe
            ok, error = False, repr(e)
        if ok:
            problem = await self._read_load(w)
            if problem:  # serving, but not a worker this router can use: out at once, not after the threshold
                w.failures += 1
                w.last_error = problem
                if w.healthy:
                    self._mark(w, False, problem)
                return False
            w.failures = 0
            w.last_error = ""  # /health reports why a worker is out, not a blip it recovered from
            if not w.healthy:
                self._mark(w, True, "health probe succeeded")
        else:
            w.failures += 1
            w.last_error = error
            if w.healthy and w.failures >= self.failure_threshold:
                self._mark(w, False, error)
        return ok

    async def _read_load(self, w: WorkerHandle) -> str:
        """The worker's load and protocol versions; returns why the router cannot use the worker:
        it refuses the router's internal token, or its protocol version does not fit ("" if fine)."""
        request = wpb.LoadRequest(protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION)
        w.inflight_peak = w.inflight
        try:
            reply = await w.transport.load(request, self.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                # Health is open to anyone; every other call needs the shared token
                refused = (f"internal token mismatch: the worker answers UNAUTHENTICATED ({e.details()}); give the "
                           "router and every worker the same --internal-token-file / PDMESH_INTERNAL_TOKEN")
                if w.last_error != refused or w.healthy:
                    log.error("internal token mismatch: the worker refuses the router's calls", role=w.role,
                              target=w.addr, error=refused)
                return refused
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the worker refuses this router's version
                problem = f"{w.role} {w.addr} refuses this router: {e.details()}"
                self._set_incompatible(w, problem)
                return problem
            return w.incompatible  # keep the last report; load is advisory, health decides admission
        finally:
            peak, w.inflight_peak = w.inflight_peak, None
        # Ours as the worker counted them is at most the most we had there during the call: a
        # request of ours that ended while the reply was on its way is not someone else's (counted
        # against our count now, it would weigh on the worker as phantom load until the next report)
        ours = max(w.inflight, peak or 0)
        w.external_load = max(0, reply.queued + reply.running - ours - w.peer_inflight)
        w.capacity_tokens = reply.kv_capacity_tokens
        w.max_model_len = reply.max_model_len
        w.lora_adapters = frozenset(reply.lora_adapters)
        if self.on_load_report is not None:
            self.on_load_report(w)
        self._note_epoch(w, reply.epoch, reply.prefix_cache_page_size)
        problem = incompatibility(f"{w.role} {w.addr}", reply.protocol_version, reply.min_protocol_version)
        self._set_incompatible(w, problem)
        return problem

    def _note_epoch(self, w: WorkerHandle, epoch: int, page_size: int) -> None:
        """A new epoch is a restarted worker with an empty cache; a new page size (or the cache
        turned off) makes the keys the router holds for it meaningless: either way they go."""
        if (w.epoch and epoch != w.epoch) or page_size != w.prefix_page_size:
            dropped = self.index.forget(w)
            if w.epoch and epoch != w.epoch:
                log.info("worker restarted (new epoch); the router forgets what it routed there", role=w.role,
                         target=w.addr, old_epoch=w.epoch, epoch=epoch, index_pages=dropped)
        w.epoch, w.prefix_page_size = epoch, page_size

    def _set_incompatible(self, w: WorkerHandle, problem: str) -> None:
        if problem and problem != w.incompatible:
            log.error("worker ejected: incompatible protocol version", role=w.role, target=w.addr, reason=problem,
                      router_protocol_version=PROTOCOL_VERSION)
        elif w.incompatible and not problem:
            log.info("worker protocol version now compatible", role=w.role, target=w.addr)
        w.incompatible = problem

    def _mark(self, w: WorkerHandle, healthy: bool, why: str) -> None:
        w.healthy = healthy
        w.last_change = time.time()
        self.pairs.forget(w)  # its own health rules now; back in the pool (maybe restarted), its pairs start clean
        if not healthy:
            w.ejections += 1
            # it may come back restarted or not at all: what it held is no longer known
            self.index.forget(w)
        if healthy:
            log.info("worker admitted", role=w.role, target=w.addr)
        else:
            log.warning("worker ejected", role=w.role, target=w.addr, reason=why, failures=w.failures)
        self._set_gauge(w)
        if not healthy:
            for notify in list(self._watchers):
                try:
                    notify(w)
                except Exception as e:  # noqa: BLE001 - one bad listener must not hide the ejection from others
                    log.error("ejection listener failed", error=repr(e))

    def watch(self, notify: Callable[[WorkerHandle], None]) -> Callable[[], None]:
        """Call notify(worker) whenever a worker is ejected; returns the unsubscribe function."""
        self._watchers.add(notify)
        return lambda: self._watchers.discard(notify)

    def _set_gauge(self, w: WorkerHandle) -> None:
        if self.metrics is not None:
            self.metrics.worker_healthy.labels(**self.metrics.labels, target=w.addr).set(1 if w.healthy else 0)

    def report_failure(self, w: WorkerHandle, code: grpc.StatusCode | None) -> None:
        """A request failed on `w`. UNAVAILABLE may mean the worker is gone: probe it now, and
        eject it at once if the probe fails too."""
        if code == grpc.StatusCode.UNAVAILABLE:
            self.confirm(w, "request failed with UNAVAILABLE")
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            self.confirm(w, "request failed with UNAUTHENTICATED")

    def confirm(self, w: WorkerHandle, why: str) -> None:
        """Something says `w` may be gone (`why`): probe it now, and eject it if the probe fails."""
        if not w.healthy:
            return

        async def confirm() -> None:
            structlog.contextvars.unbind_contextvars("room", "request_id")
            if not await self.probe(w) and w.healthy:
                self._mark(w, False, f"{why} and the probe failed: {w.last_error}")

        task = asyncio.ensure_future(confirm())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- selection -----------------------------------------------------------------------------

    def decode_capacity(self) -> int | None:
        """The most tokens (prompt + completion) one request can take on the roomiest healthy
        decode: its KV pool's size, or its --max-model-len when that is smaller (None: none has said)."""
        return max((min(w.capacity_tokens, w.max_model_len or w.capacity_tokens)
                    for w in self.decodes if w.healthy and w.capacity_tokens), default=None)

    def reserve(self, worker: WorkerHandle) -> Lease:
        """One in-flight count on `worker` (its load for the policies and the other router
        processes), held until the lease is released (exactly once, services/router/leases.py)."""
        return Lease(worker._count_inflight, 1, self.leases)

    def has_healthy_pair(self) -> bool:
        return (self.colocated or any(w.healthy for w in self.prefills)) and any(w.healthy for w in self.decodes)

    async def choose_pair(
        self, exclude: Iterable[WorkerHandle] = (), prefill: WorkerHandle | None = None, prompt: RequestKeys | None = None,
        allow_local: bool = False, avoid_pairs: Iterable[tuple[WorkerHandle | None, WorkerHandle]] = (),
    ) -> PairLease:
        """A healthy (prefill, decode), avoiding `exclude` when another healthy worker exists;
        colocated: (None, decode). `prefill`: take that prefill while it is healthy and not
        excluded (the n choices of one request share one prefill, services/router/fanout.py).
        `prompt`: the ids the pair will be sent (cache_aware reads the index with them; both
        chosen workers are then recorded as holding them). `allow_local`: the request may skip
        prefill (conditional disaggregation, services/router/conditional_disagg.py): when the
        decode the policy picks holds all but a short tail of the prompt, the pair is
        (None, decode) and decode computes the tail itself.

        The pair comes reserved: a lease on each worker's in-flight count, taken with no await
        between choosing and counting (so concurrent requests see each other's load); the caller
        releases it (`PairLease.release()`, idempotent).
        """
        excluded = set(exclude)
        failed = set(avoid_pairs)

        roles = (("decode", self.decodes),) if self.colocated else (("prefill", self.prefills), ("decode", self.decodes))
        probed = False
        for role, group in roles:
            if not any(w.healthy for w in group):
                await self.probe_all(group, fresh=True)  # bounded by twice the probe timeout
                probed = True
                if not any(w.healthy for w in group):
                    raise no_healthy_workers(role)
        if probed:
            for role, group in roles:  # a group may have emptied while another was probed (an await above)
                if not any(w.healthy for w in group):
                    raise no_healthy_workers(role)
        # no await from here on. With no pair marked or avoided (the usual request) no pair is bad:
        # nothing to test per pair
        bad = self._bad_pairs(failed) if failed or self.pairs.any_marked() else None
        match = PrefixMatch(self.index, prompt) if self.cache_aware and prompt is not None else None
        # decode first (each role's policy is its own, so the order changes no choice): whether
        # the request needs a prefill at all depends on what the chosen decode holds
        decodes = self._candidates(self.decodes, excluded)
        decode = self._policies["decode"].choose(decodes, load_of, match)
        local = (allow_local and match is not None and self.local_prefill_max_tokens > 0
                 and goes_local(match.total, match.matched(decode), decode.prefix_page_size,
                                self.local_prefill_max_tokens))
        if self.colocated or local:
            prefill = None
        elif not (prefill is not None and prefill.healthy and prefill not in excluded and prefill in self.prefills):
            good = None if bad is None else [p for p in self._candidates(self.prefills, excluded)
                                             if not bad(p, decode)]
            if good:
                # the decode the policy chose (for its load or its cache) stays chosen; among its
                # good prefills the least loaded, on a tie the one chosen longest ago. Choosing the
                # prefill with its policy and then the decode again starves a decode whose good
                # pairs are few whenever the two policies' tie cursors move in step
                prefill = min(good, key=_least_loaded_then_longest_unchosen)
            else:
                prefills = (self._candidates(self.prefills, excluded) if bad is None
                            else self._prefills_with_a_good_pair(excluded, bad))
                prefill = self._policies["prefill"].choose(prefills, load_of, match)
        if prefill is not None and bad is not None and bad(prefill, decode):
            # choose again among the pair's good decodes (not from the start among a shrunken list,
            # whose round-robin would starve a worker); every pair bad: route anyway
            good = [d for d in decodes if not bad(prefill, d)]
            if good:
                decode = self._policies["decode"].choose(good, load_of, match)
        prefill_lease = None
        if prefill is not None:
            prefill_lease = self.reserve(prefill)
            self.pairs.touch(prefill, decode)
            self._turn += 1
            prefill.chosen_turn = self._turn
        decode_lease = self.reserve(decode)
        if match is not None and prefill is not None:
            # prefill caches the prompt's pages as it computes them; decode is remembered only
            # once a request finishes there (the orchestrator), so a failed transfer leaves no
            # entry for pages decode never received
            self.remember(prefill, prompt)
        return PairLease(prefill, decode, prefill_lease, decode_lease)

    def remember(self, w: WorkerHandle, ids: RequestKeys) -> None:
        """`w` was sent `ids` (a prompt; on decode, after the request, its prompt + reply): its
        prefix cache should hold their full pages now."""
        if self.cache_aware and w.prefix_page_size:
            size = w.prefix_page_size
            self.index.insert(w, ids.for_page_size(size), cap=w.capacity_tokens // size)

    def _bad_pairs(self, failed: set[tuple[WorkerHandle | None, WorkerHandle]]) -> Callable[[WorkerHandle, WorkerHandle], bool]:
        """Whether a pair is to be avoided: this request failed on it, or it is marked."""
        def bad(p: WorkerHandle, d: WorkerHandle) -> bool:
            return (p, d) in failed or self.pairs.is_marked(p, d)

        return bad

    @staticmethod
    def _candidates(group: list[WorkerHandle], excluded: set[WorkerHandle]) -> list[WorkerHandle]:
        healthy = [w for w in group if w.healthy]
        return ([w for w in healthy if w not in excluded] or healthy) if excluded else healthy

    def _prefills_with_a_good_pair(self, excluded: set[WorkerHandle], bad: Callable[[WorkerHandle, WorkerHandle], bool]) -> list[WorkerHandle]:
        """The candidate prefills that have at least one good pair with a candidate decode
        (all of them when none has: marks steer, they never refuse)."""
        prefills = self._candidates(self.prefills, excluded)
        decodes = self._candidates(self.decodes, excluded)
        return [p for p in prefills if any(not bad(p, d) for d in decodes)] or prefills

    def pairs_status(self) -> list[dict]:
        return [{"prefill": p.addr, "decode": d.addr, "reason": m.reason, "failures": m.failures}
                for (p, d), m in self.pairs.marks().items()]

    def unavailable_reason(self) -> str:
        """Why no healthy pair exists ("" when one does): each role without a healthy worker, with
        its workers' last errors."""
        roles = (("decode", self.decodes),) if self.colocated else (("prefill", self.prefills), ("decode", self.decodes))
        reasons = []
        for role, group in roles:
            if not any(w.healthy for w in group):
                errors = "; ".join(f"{w.addr}: {w.last_error or 'not admitted yet'}" for w in group) or "none configured"
                reasons.append(f"no healthy {role} worker ({errors})")
        return ". ".join(reasons)

    def status(self) -> dict:
        def one(w: WorkerHandle) -> dict:
            return {
                "healthy": w.healthy,
                "inflight": w.inflight,
                "external_load": w.external_load,
                "kv_capacity_tokens": w.capacity_tokens or None,
                "max_model_len": w.max_model_len or None,
                "epoch": w.epoch or None,
                "prefix_index_pages": self.index.pages(w),
                "last_error": w.last_error or None,
            }

        return {
            "prefill": {w.addr: one(w) for w in self.prefills},
            "decode": {w.addr: one(w) for w in self.decodes},
            "marked_pairs": self.pairs_status(),
        }
