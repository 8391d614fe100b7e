"""The random built-in model on CPU with a prefix cache, as the prefill and decode prefix-cache
tests drive it, and the pool check each of their tests ends with."""

from __future__ import annotations

import contextlib

from services.engine.worker_engine import WorkerEngine


def random_engine_with_prefix_cache(num_pages, page_size):
    return WorkerEngine("builtin-random", "cpu", "float32", num_pages, page_size, prefix_cache=True)


@contextlib.contextmanager
def empty_cache_then_whole_pool(engine, zero_kv=False):
    """Starts from an empty prefix cache (and zeroed KV, for tests that compare KV); at the end
    the cache is consistent and every page is free, or cached with no holder."""
    engine.prefix_cache.clear()
    if zero_kv:
        engine.pool.kv.zero_()
    yield
    engine.prefix_cache.check_integrity()
    assert engine.pool.allocator.is_whole()
