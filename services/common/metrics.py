"""Every Prometheus metric of pdmesh, defined here and nowhere else.

Names follow SGLang's with a `pdmesh:` prefix, so dashboards port by swapping the prefix.
Queue gauges are computed at scrape time from the live queues (set_function), never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "pdmesh:"
LABELS = ("model_name", "engine_type", "worker")

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB

# Queue gauges per role (computed from live state at scrape time).
PREFILL_GAUGES = (
    "num_prefill_bootstrap_queue_reqs",
    "num_prefill_inflight_queue_reqs",
    "num_queue_reqs",
    "num_running_reqs",
    "token_usage",
)
DECODE_GAUGES = (
    "num_decode_prealloc_queue_reqs",
    "num_decode_transfer_queue_reqs",
    "num_running_reqs",
    "num_retracted_reqs",
    "token_usage",
)
ROUTER_GAUGES = ("num_running_reqs",)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One registry per process; label values fixed at construction."""

    def __init__(self, engine_type: str, model_name: str, worker: str):
        self.registry = CollectorRegistry()
        self._children: dict[tuple, object] = {}  # child()'s series; label values come from small fixed sets
        self.labels = {"model_name": model_name, "engine_type": engine_type, "worker": worker}
        r = self.registry
        gauge_names = {"prefill": PREFILL_GAUGES, "decode": DECODE_GAUGES, "router": ROUTER_GAUGES}[engine_type]
        self._gauges = {n: Gauge(PREFIX + n, _GAUGE_HELP[n], LABELS, registry=r) for n in gauge_names}
        self.up = Gauge(PREFIX + "up", "1 while this process serves", LABELS, registry=r)
        self.up.labels(**self.labels).set(1)

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, LABELS + tuple(extra), registry=r)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=r)

        self.num_requests = counter("num_requests_total", "requests received")
        self.num_aborted_requests = counter("num_aborted_requests_total", "requests aborted (client, peer or watchdog)")
        self.num_bootstrap_failed_reqs = counter(
            "num_bootstrap_failed_reqs_total", "requests failed before decode attached / before prefill accepted"
        )
        self.num_transfer_failed_reqs = counter("num_transfer_failed_reqs_total", "requests whose KV transfer failed")
        self.num_retractions = counter(
            "num_retractions_total", "times decode retracted a running request for lack of KV pages"
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
        # prefill: tokens a forward computed, so n > 1 (one prompt, n choices) counts the prompt once
        self.prompt_tokens = counter("prompt_tokens_total", "prompt tokens processed (prefill: computed)")
        self.shared_prompt_tokens = counter(
            "shared_prompt_tokens_total",
            "prefill: prompt tokens whose KV was copied from another choice of the same n > 1 request",
        )
        if engine_type == "prefill":
            self.shared_prompt_tokens.labels(**self.labels)  # at 0 from the start
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
        self.worker_healthy = Gauge(
            PREFIX + "worker_healthy", "1 if the router considers the worker healthy", LABELS + ("target",), registry=r
        )
        self.time_to_first_token = histogram("time_to_first_token_seconds", "time to first token")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "time between consecutive tokens")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "end-to-end request latency")
        self.kv_transfer_latency = histogram("kv_transfer_latency_seconds", "KV transfer time (post to done)")
        self.kv_transfer_bytes = histogram("kv_transfer_bytes", "bytes of KV sent per request", BYTES_BUCKETS)
        self.event_loop_lag = histogram("event_loop_lag_seconds", "asyncio event loop scheduling lag")

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

_EVICTION_QUEUES = {"prefill": ("bootstrap", "inflight"), "decode": ("prealloc", "transfer")}

_GAUGE_HELP = {
    "num_prefill_bootstrap_queue_reqs": "prefill requests waiting for decode to attach",
    "num_prefill_inflight_queue_reqs": "prefill requests whose KV is being sent to decode",
    "num_queue_reqs": "prefill requests waiting to be scheduled for a forward",
    "num_running_reqs": "requests in a forward (prefill), the decode batch (decode), or in flight (router)",
    "token_usage": "fraction of KV pages in use",
    "num_decode_prealloc_queue_reqs": "decode requests waiting for KV pages",
    "num_decode_transfer_queue_reqs": "decode requests waiting for their KV to arrive",
    "num_retracted_reqs": "decode requests that gave up their KV pages (pool full) and wait to recompute",
}
