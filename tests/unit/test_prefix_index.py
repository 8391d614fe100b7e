"""The router's approximate prefix index (services/router/prefix_index.py) as pure logic: keys are
the workers' own, matches are prefixes, memory is bounded, eviction keeps a prefix."""

from __future__ import annotations

import pytest

from services.engine.prefix_cache import page_keys
from services.router.prefix_index import PrefixIndex, RequestKeys

P = 4


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_keys_are_the_workers_own_and_computed_once_per_page_size():
    rk = RequestKeys(ids(10))
    assert rk.for_page_size(P) == page_keys(ids(10), P) and len(rk.for_page_size(P)) == 2
    assert rk.for_page_size(P) is rk.for_page_size(P)
    assert rk.for_page_size(3) == page_keys(ids(10), 3)


def test_extending_a_chain_hashes_only_the_new_pages_and_equals_a_fresh_chain():
    prompt = RequestKeys(ids(10))
    prompt.for_page_size(P)
    longer = prompt.extended(ids(23))
    assert longer.for_page_size(P) == page_keys(ids(23), P) and len(longer) == 23
    other = prompt.extended([99, *ids(22)])  # does not start with the prompt: computed afresh
    assert other.for_page_size(P) == page_keys([99, *ids(22)], P)


def test_a_salted_request_has_the_workers_salted_keys_and_extends_them_under_its_salt():
    from services.engine.page_allocator import PageAllocator
    from services.engine.prefix_cache import PrefixCache

    worker_cache = PrefixCache(PageAllocator(8), P)
    salted = RequestKeys(ids(10), "tenant-1")
    assert salted.for_page_size(P) == worker_cache.keys(ids(10), "tenant-1") != page_keys(ids(10), P)
    longer = salted.extended(ids(23))
    assert longer.salt == "tenant-1" and longer.for_page_size(P) == worker_cache.keys(ids(23), "tenant-1")
    index = PrefixIndex(100)
    index.insert("w", salted.for_page_size(P))
    assert index.match("w", salted.for_page_size(P)) == 2
    assert index.match("w", RequestKeys(ids(10)).for_page_size(P)) == 0  # unsalted: another tenant's cache
    assert index.match("w", RequestKeys(ids(10), "tenant-2").for_page_size(P)) == 0


def test_match_counts_the_leading_pages_a_worker_was_sent():
    index = PrefixIndex(100)
    a = RequestKeys(ids(20)).for_page_size(P)  # 5 pages
    index.insert("w1", a[:3])
    assert index.match("w1", a) == 3
    assert index.match("w2", a) == 0
    diverged = RequestKeys([*ids(8), 77, *ids(11, 9)]).for_page_size(P)  # differs in page 3
    assert index.match("w1", diverged) == 2
    assert index.match("w1", RequestKeys(ids(20, 1)).for_page_size(P)) == 0  # same tokens, shifted


def test_memory_is_bounded_and_eviction_leaves_the_first_pages():
    index = PrefixIndex(6)
    old = RequestKeys(ids(16, 1000)).for_page_size(P)  # 4 pages
    index.insert("w", old)
    new = RequestKeys(ids(16)).for_page_size(P)
    index.insert("w", new)
    assert index.pages("w") == 6
    # the newest chain is whole; of the older one, its first pages are what is left
    assert index.match("w", new) == 4 and index.match("w", old) == 2
    index.insert("w", new, cap=3)  # the worker's own pool holds 3 pages
    assert index.pages("w") == 3 and index.match("w", new) == 3 and index.match("w", old) == 0


def test_forget_and_clear():
    index = PrefixIndex(100)
    k = RequestKeys(ids(12)).for_page_size(P)
    index.insert("a", k)
    index.insert("b", k[:1])
    assert index.forget("a") == 3 and index.match("a", k) == 0 and index.match("b", k) == 1
    assert index.forget("a") == 0
    assert index.clear() == 1 and index.pages("b") == 0


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError):
        PrefixIndex(0)
