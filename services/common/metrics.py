"""Every Prometheus metric of pdmesh, defined here and nowhere else.

The workers' names are SGLang's (0.5.x) with a `pdmesh:` prefix, so dashboards port by swapping
the prefix; a series renamed to match SGLang keeps its former name as an alias for one release
(`RENAMED`). The router's series have names of their own (`pdmesh:router_*`): it sees the same
requests and tokens as the workers, so a `sum()` over one name must not count them twice.
`model_name` is the served name (`--served-model-name`) on every role.
Queue gauges are computed at scrape time from the live queues (set_function), never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from services.common.rate_window import RateWindow

PREFIX = "pdmesh:"
LABELS = ("model_name", "engine_type", "worker")

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Inter-token gaps on a GPU are 1-10 ms: 1 ms steps there, coarser above.
ITL_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0125, 0.015, 0.0175,
               0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10, 30)
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB

# Queue gauges per role (computed from live state at scrape time).
POOL_GAUGES = ("token_usage", "num_used_tokens", "max_total_num_tokens")
PREFILL_GAUGES = (
    "num_prefill_prealloc_queue_reqs",
    "num_prefill_inflight_queue_reqs",
    "num_queue_reqs",
    "num_running_reqs",
    *POOL_GAUGES,
    "cache_hit_rate",
    "prefix_cache_pages",
)
DECODE_GAUGES = (
    "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs",
    "num_running_reqs",
    "num_retracted_reqs",
    *POOL_GAUGES,
    "cache_hit_rate",
    "prefix_cache_pages",
)
ROUTER_GAUGES = ("num_running_reqs",)

# Former name -> SGLang's name (without the prefix); the former is still exported, with the same
# samples, until the next release. Dashboards and alerts should use the new names.
RENAMED = {
    "num_prefill_bootstrap_queue_reqs": "num_prefill_prealloc_queue_reqs",
    "num_retractions": "num_retracted_requests",
}

# The router's names for what it measures of the requests it serves (client-side: TTFT and ITL
# as the client sees them, tokens it streamed back). Prefixed `router_` so that `sum()` over a
# worker name never adds the router's count of the same requests.
ROUTER_OWN = frozenset({
    "num_requests_total", "num_aborted_requests_total", "prompt_tokens_total", "generation_tokens_total",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "num_running_reqs",
})
KV_READ_FAILURE_REASONS = ("error", "timeout", "checksum")  # services/transfer/reader.py's REASONS
GEN_THROUGHPUT_WINDOW = 10.0  # seconds of generated tokens gen_throughput averages over

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One registry per process; label values fixed at construction."""

    def __init__(self, engine_type: str, model_name: str, worker: str):
        self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}  # child()'s series; label values come from small fixed sets
        self.labels = {"model_name": model_name, "engine_type": engine_type, "worker": worker}
        r = self.registry
        router = engine_type == "router"

        def full(name):
            return PREFIX + ("router_" + name if router and name in ROUTER_OWN else name)

        gauge_names = {"prefill": PREFILL_GAUGES, "decode": DECODE_GAUGES, "router": ROUTER_GAUGES}[engine_type]
        self._gauges = {n: Gauge(full(n), _GAUGE_HELP[n], LABELS, registry=r) for n in gauge_names}
        # 1 once this process serves; a worker's /metrics answers (at 0) while its model loads
        self.up = Gauge(PREFIX + "up", "1 while this process serves (0 while a worker loads its model)",
                        LABELS, registry=r)
        self.set_serving(engine_type == "router")

        def counter(name, doc, extra=()):
            return Counter(full(name), doc, LABELS + tuple(extra), registry=r)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(full(name), doc, LABELS, buckets=buckets, registry=r)

        self.num_requests = counter("num_requests_total", "requests received")
        self.num_aborted_requests = counter("num_aborted_requests_total", "requests aborted (client, peer or watchdog)")
        self.num_bootstrap_failed_reqs = counter(
            "num_bootstrap_failed_reqs_total", "requests failed before decode attached / before prefill accepted"
        )
        self.kv_integrity_failures = counter(
            "kv_integrity_failures_total",
            "rooms whose KV failed the KV checksum on arrival (decode; the room fails, the router fails over)",
            ("prefill", "decode"),
        )
        self.num_transfer_failed_reqs = counter("num_transfer_failed_reqs_total", "requests whose KV transfer failed")
        self.num_retractions = counter(
            "num_retracted_requests_total", "times decode retracted a running request for lack of KV pages"
        )
        if engine_type == "decode":
            self.num_retractions.labels(**self.labels)  # at 0 from the start, like the evictions
        self.watchdog_evictions = counter(
            "watchdog_evictions_total", "entries evicted by the watchdog for exceeding their queue deadline", ("queue",)
        )
        # Create each queue's eviction series at 0, so a first eviction shows up as a rise
        # (Prometheus' rate()/increase() cannot see a series that is born at 1).
        for queue in _EVICTION_QUEUES.get(engine_type, ()):
            self.watchdog_evictions.labels(**self.labels, queue=queue)
        # prefill: tokens a forward computed, so n > 1 (one prompt, n choices) counts the prompt's
        # full pages once: the other choices take them from the prefix cache
        self.prompt_tokens = counter("prompt_tokens_total", "prompt tokens processed (prefill: computed)")
        self.shared_prompt_tokens = counter(
            "shared_prompt_tokens_total",
            "prefill: of the prefix cache hits, prompt tokens an n > 1 choice took from the choice that computed them",
        )
        if engine_type == "prefill":
            self.shared_prompt_tokens.labels(**self.labels)  # at 0 from the start
        # the prefix cache, with vLLM's meaning: tokens looked up, tokens found (not computed),
        # cached pages taken back for new requests
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total",
            "prompt tokens found in the prefix cache (prefill, colocated decode: not computed; decode: not received)",
        )
        self.prefix_cache_evictions = counter(
            "prefix_cache_evictions_total", "cached KV pages evicted (no holder) to make room for a request"
        )
        if engine_type in ("prefill", "decode"):
            for m in (self.prefix_cache_queries, self.prefix_cache_hits, self.prefix_cache_evictions):
                m.labels(**self.labels)  # at 0 from the start
        # prefill's READ of the prompt pages decode holds (services/transfer/reader.py)
        self.kv_read_pages = counter(
            "kv_read_pages_total",
            "prefill: prompt pages read from decode's held prefix (NIXL READ, verified) instead of computed",
        )
        self.kv_read_bytes = counter("kv_read_bytes_total", "prefill: bytes of the verified READs of decode's held prefix")
        self.kv_read_failures = counter(
            "kv_read_failures_total",
            "prefill: READs of decode's held prefix that gave nothing, by reason (error, timeout, checksum); "
            "their tokens were computed",
            ("reason",),
        )
        self.kv_read_latency = histogram("kv_read_latency_seconds", "prefill: a verified READ of decode's held prefix, "
                                         "from its post to its handle's release")
        if engine_type == "prefill":  # at 0 from the start
            self.kv_read_pages.labels(**self.labels)
            self.kv_read_bytes.labels(**self.labels)
            for reason in KV_READ_FAILURE_REASONS:
                self.kv_read_failures.labels(**self.labels, reason=reason)
        self.generation_tokens = counter("generation_tokens_total", "tokens generated")
        self.router_requests = counter("router_requests_total", "router requests by HTTP status", ("status",))
        self.router_migrations = counter(
            "router_migrations_total",
            "requests the router moved to another worker pair after their first token, by reason",
            ("reason",),
        )
        if engine_type == "router":  # at 0 from the start, so a first migration shows up as a rise
            for reason in ROUTER_MIGRATION_REASONS:
                self.router_migrations.labels(**self.labels, reason=reason)
        # conditional disaggregation (services/router/conditional_disagg.py): attempts sent to a
        # decode alone in PD mode, which computed the prompt's uncached tail itself
        self.router_local_prefill_requests = counter(
            "router_local_prefill_requests_total",
            "attempts the router sent (PD mode) to a decode alone, which computed the prompt's short uncached "
            "part itself: no prefill, no KV transfer (--local-prefill-max-tokens)",
        )
        if engine_type == "router":
            self.router_local_prefill_requests.labels(**self.labels)  # at 0 from the start
        # (prefill, decode) pairs (services/router/pair_health.py) and the canary that tests them
        self.router_pair_failures = counter(
            "router_pair_failures_total",
            "attempts whose KV path failed between this prefill and decode while both stayed healthy",
            ("prefill", "decode"),
        )
        self.canary_requests = counter(
            "canary_requests_total", "canary requests through a (prefill, decode) pair, by result (pass, fail)",
            ("prefill", "decode", "result"),
        )
        self.canary_latency = histogram("canary_latency_seconds", "time a passing canary took, end to end")
        self.router_client_cutoffs = counter(
            "router_client_cutoffs_total",
            "client connections the router cut off, by reason: header_timeout, header_size (past "
            "--max-header-bytes), body_timeout, "
            "write_timeout (a response blocked on a client reading nothing), buffer (a stream's client too "
            "far behind), connection_limit (an idle connection closed, or a new one refused, at --max-connections)",
            ("reason",),
        )
        self.router_tls_reloads = counter(
            "router_tls_reloads_total",
            "times the router built its TLS context again after its certificate files changed "
            "(--enable-ssl-refresh), by outcome: reloaded, or failed (the previous certificate still served)",
            ("outcome",),
        )
        self.router_tls_reload_failing = Gauge(
            PREFIX + "router_tls_reload_failing",
            "1 while the router's certificate files, changed, do not load (--enable-ssl-refresh): it still "
            "serves the certificate it loaded before",
            LABELS, registry=r)
        if engine_type == "router":
            self.router_tls_reload_failing.labels(**self.labels).set(0)
            for outcome in ("reloaded", "failed"):
                self.router_tls_reloads.labels(**self.labels, outcome=outcome)
            for reason in ROUTER_CUTOFF_REASONS:
                self.router_client_cutoffs.labels(**self.labels, reason=reason)
        self.worker_healthy = Gauge(
            PREFIX + "worker_healthy", "1 if the router considers the worker healthy", LABELS + ("target",), registry=r
        )
        self.time_to_first_token = histogram("time_to_first_token_seconds", "time to first token")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "time between consecutive tokens",
                                             ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "end-to-end request latency")
        self.queue_time = histogram(
            "queue_time_seconds",
            "prefill: from arrival (the wait for decode to attach included) to the first forward; "
            "decode: from arrival to its KV pages being allocated",
        )
        self.kv_transfer_latency = histogram("kv_transfer_latency_seconds", "KV transfer time (post to done)")
        self.kv_transfer_bytes = histogram("kv_transfer_bytes", "bytes of KV sent per request", BYTES_BUCKETS)
        self.event_loop_lag = histogram("event_loop_lag_seconds", "asyncio event loop scheduling lag")
        self.generated = RateWindow(GEN_THROUGHPUT_WINDOW)
        if engine_type == "decode":
            Gauge(PREFIX + "gen_throughput", f"tokens generated per second over the last {GEN_THROUGHPUT_WINDOW:g} s",
                  LABELS, registry=r).labels(**self.labels).set_function(self.generated.rate)
        if engine_type == "prefill":
            self.kv_transfer_latency_ms = Gauge(
                PREFIX + "kv_transfer_latency_ms", "the last KV transfer's time, post to done, in ms", LABELS, registry=r)
            self.kv_transfer_speed_gb_s = Gauge(
                PREFIX + "kv_transfer_speed_gb_s", "the last KV transfer's speed in GB/s", LABELS, registry=r)
            self.kv_transfer_total_mb = Gauge(
                PREFIX + "kv_transfer_total_mb", "the last KV transfer's size in MB", LABELS, registry=r)
        renamed = {"prefill": {"num_prefill_prealloc_queue_reqs": self._gauges.get("num_prefill_prealloc_queue_reqs")},
                   "decode": {"num_retracted_requests": self.num_retractions}}.get(engine_type, {})
        for old, new in RENAMED.items():
            if new in renamed:
                r.register(_Alias(renamed[new], PREFIX + old, PREFIX + new))

    def pairs_from(self, fn: Callable[[], list[tuple[str, str]]]) -> None:
        """`pdmesh:router_pair_marked{prefill,decode}` = 1 for each pair fn() lists, read at scrape
        time (a mark may expire between scrapes)."""
        labels = self.labels

        class Marked:
            def collect(self):
                family = GaugeMetricFamily(PREFIX + "router_pair_marked",
                                           "1 for each (prefill, decode) pair the router avoids: its KV path failed",
                                           labels=[*LABELS, "prefill", "decode"])
                for prefill, decode in fn():
                    family.add_metric([*labels.values(), prefill, decode], 1)
                yield family

        self.registry.register(Marked())

    # helpers that apply this process's labels
    def gauge_from(self, name: str, fn: Callable[[], float]) -> None:
        self._gauges[name].labels(**self.labels).set_function(fn)

    def set_serving(self, serving: bool) -> None:
        self.up.labels(**self.labels).set(1 if serving else 0)

    def pool_gauges(self, pool) -> None:
        """token_usage, num_used_tokens and max_total_num_tokens of a KV pool (services/engine/kv_pool.py)."""
        self.gauge_from("token_usage", lambda: pool.token_usage)
        self.gauge_from("num_used_tokens", lambda: pool.allocator.num_used * pool.page_size)
        self.gauge_from("max_total_num_tokens", lambda: pool.num_pages * pool.page_size)

    def generated_tokens(self, n: int = 1) -> None:
        """Tokens this decode worker generated: the counter and gen_throughput's window."""
        self.child(self.generation_tokens).inc(n)
        self.generated.add(n)

    def transferred(self, seconds: float, nbytes: int) -> None:
        """One KV transfer done (prefill): the histograms and SGLang's last-transfer gauges."""
        self.observe(self.kv_transfer_latency, seconds)
        self.observe(self.kv_transfer_bytes, nbytes)
        self.child(self.kv_transfer_latency_ms).set(seconds * 1e3)
        self.child(self.kv_transfer_total_mb).set(nbytes / 1e6)
        self.child(self.kv_transfer_speed_gb_s).set(nbytes / 1e9 / seconds if seconds > 0 else 0.0)

    def child(self, metric, **extra):
        """The metric's series for this process's labels + `extra`, looked up once: labels() costs
        a lock, a dict and a tuple per call, and the router calls it several times per request."""
        key = (metric, *extra.items())
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(**self.labels, **extra)
        return found

    def inc(self, metric: Counter, amount: float = 1.0, **extra) -> None:
        self.child(metric, **extra).inc(amount)

    def observe(self, metric: Histogram, value: float) -> None:
        self.child(metric).observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of one value on a histogram's series, as `count` calls of observe()
    would record them (the sum takes value x count at once, equal up to float rounding): the
    router's inter-token latency is one gap per token of a chunk, many tokens a chunk on a fast
    decode. Reads prometheus_client's fields; where they are not there, it calls observe()."""
    try:
        total, buckets, bounds = histogram._sum, histogram._buckets, histogram._upper_bounds
    except AttributeError:
        for _ in range(count):
            histogram.observe(value)
        return
    if count <= 0:
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break


class _Alias:
    """A metric's samples again under its former name (a custom collector, so the two never
    disagree): one release of grace for dashboards that use the old name."""

    def __init__(self, metric, old: str, new: str):
        self.metric, self.old, self.new = metric, old, new

    def collect(self):
        for family in self.metric.collect():
            alias = Metric(self.old, f"{family.documentation} (former name of {self.new}; removed next release)",
                           family.type)
            for sample in family.samples:
                alias.add_sample(self.old + sample.name[len(self.new):], sample.labels, sample.value,
                                 sample.timestamp, sample.exemplar)
            yield alias


def router_processes_exposition(configured: int, scraped: int) -> bytes:
    """The gauges a scrape of a router with --processes N > 1 adds to its processes' series
    (services/router/sibling_metrics.py): how many there are, and how many this scrape holds."""
    r = CollectorRegistry()
    Gauge(PREFIX + "router_processes", "router processes configured (--processes)", registry=r).set(configured)
    Gauge(PREFIX + "router_processes_scraped", "router processes whose series this scrape holds",
          registry=r).set(scraped)
    return generate_latest(r)


# services/router/migration.py's reasons: the decode's stream failed, the pool ejected it, it went
# silent past --stream-stall-timeout, or its stream ended without a finish reason.
ROUTER_MIGRATION_REASONS = ("decode_failed", "decode_ejected", "decode_stalled", "stream_ended")
ROUTER_CUTOFF_REASONS = ("header_timeout", "header_size", "body_timeout", "write_timeout", "buffer",
                         "connection_limit")

_EVICTION_QUEUES = {"prefill": ("bootstrap", "inflight"), "decode": ("prealloc", "transfer")}

_GAUGE_HELP = {
    "num_prefill_prealloc_queue_reqs": "prefill requests waiting for decode to attach (SGLang's bootstrap queue)",
    "num_prefill_inflight_queue_reqs": "prefill requests whose KV is being sent to decode",
    "num_queue_reqs": "prefill requests waiting to be scheduled for a forward",
    "num_running_reqs": "requests in a forward (prefill), the decode batch (decode), or in flight (router)",
    "token_usage": "fraction of KV pages in use",
    "num_used_tokens": "tokens the KV pages in use can hold (pages in use x page size)",
    "max_total_num_tokens": "tokens the whole KV pool holds (pages x page size)",
    "num_decode_prealloc_queue_reqs": "decode requests waiting for KV pages",
    "num_decode_transfer_queue_reqs": "decode requests waiting for their KV to arrive",
    "num_retracted_reqs": "decode requests that gave up their KV pages (pool full) and wait to recompute",
    "cache_hit_rate": "prefix cache hits / queries, in prompt tokens, since the worker started (0 before any query)",
    "prefix_cache_pages": "KV pages the prefix cache holds (with or without a request using them)",
}
