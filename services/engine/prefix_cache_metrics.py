"""A worker's prefix-cache series (services/common/metrics.py) fed from its PrefixCache."""

from __future__ import annotations

from services.common.metrics import Metrics
from services.engine.prefix_cache import PrefixCache


def watch_prefix_cache(metrics: Metrics, cache: PrefixCache | None) -> None:
    """Gauges read the cache at scrape time; evictions count as they happen. With the cache off
    the gauges read 0 and the counters stay at 0."""
    metrics.gauge_from("cache_hit_rate", lambda: cache.hit_rate if cache else 0.0)
    metrics.gauge_from("prefix_cache_pages", lambda: cache.num_pages if cache else 0)
    if cache is not None:
        cache.on_evicted = lambda _page: metrics.inc(metrics.prefix_cache_evictions)


def count_lookup(metrics: Metrics, cache: PrefixCache, query_tokens: int, hit_tokens: int) -> None:
    cache.record(query_tokens, hit_tokens)
    metrics.inc(metrics.prefix_cache_queries, query_tokens)
    metrics.inc(metrics.prefix_cache_hits, hit_tokens)
