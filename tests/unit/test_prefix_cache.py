"""The prefix cache's keys, hits, inserts, evictions and reset, in milliseconds (no torch)."""

import pytest

from services.engine.page_allocator import AllocatorError, OutOfPages, PageAllocator
from services.engine.prefix_cache import PrefixCache, page_keys

P = 4  # tokens per page


@pytest.fixture
def cache():
    c = PrefixCache(PageAllocator(16), P)
    yield c
    c.check_integrity()  # after every test, whatever it did


def run(cache: PrefixCache, owner, tokens: list[int]) -> tuple[list[int], int]:
    """What a prefill job does: hit, allocate the rest, compute, cache its full pages."""
    hit = cache.acquire(tokens, owner)
    pages = hit + cache.allocator.alloc(-(-len(tokens) // P) - len(hit), owner)
    cache.insert(tokens, pages, len(tokens) // P)
    return pages, len(hit) * P


def test_keys_chain_the_prefix():
    a = page_keys(list(range(12)), P)
    b = page_keys([*range(4), 99, *range(5, 12)], P)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # a change reaches every later key
    assert page_keys(list(range(11)), P) == a[:2]  # full pages only
    assert page_keys(list(range(12)), P, 1) == a[:1]
    assert page_keys([1, 2, 3, 4], P) != page_keys([4, 3, 2, 1], P)


def test_second_request_hits_the_shared_prefix_only(cache):
    first = list(range(10))  # pages: [0..3] [4..7] [8, 9]
    pages_a, cached_a = run(cache, "a", first)
    assert cached_a == 0 and cache.num_pages == 2
    second = [*range(8), 50, 51, 52, 53, 54]
    pages_b, cached_b = run(cache, "b", second)
    assert cached_b == 8 and pages_b[:2] == pages_a[:2] and set(pages_b[2:]).isdisjoint(pages_a)
    assert cache.allocator.holders_of(pages_a[0]) == {"a", "b"}
    cache.allocator.free(pages_a, "a")
    cache.allocator.free(pages_b, "b")
    assert cache.allocator.is_whole() and cache.num_pages == 3


def test_a_hit_always_leaves_a_token_to_compute(cache):
    tokens = list(range(8))  # exactly two pages
    pages, _ = run(cache, "a", tokens)
    assert cache.num_pages == 2
    assert cache.match(tokens) == pages[:1]  # the last page is recomputed into a page of its own
    assert cache.match([*tokens, 8]) == pages
    assert cache.match([]) == [] and cache.match([0]) == []
    assert cache.match([*tokens, 8], keys=cache.keys([*tokens, 8])) == pages  # precomputed keys: same hit
    cache.allocator.free(pages, "a")


def test_a_prefix_computed_twice_at_once_keeps_one_page(cache):
    tokens = list(range(9))
    a = cache.allocator.alloc(3, "a")
    b = cache.allocator.alloc(3, "b")
    assert cache.insert(tokens, a, 2) == 2
    assert cache.insert(tokens, b, 2) == 0  # b's pages stay its own
    assert cache.match([*tokens, 9]) == a[:2]
    cache.allocator.free(a, "a")
    cache.allocator.free(b, "b")
    assert cache.allocator.num_idle == 2 and cache.allocator.num_free == 14


def test_eviction_forgets_the_key_and_the_chain_ends_there(cache):
    evicted = []
    cache.on_evicted = evicted.append
    tokens = list(range(13))
    pages, _ = run(cache, "a", tokens)
    cache.allocator.free(pages, "a")
    assert cache.allocator.num_idle == 3
    other = cache.allocator.alloc(15, "x")  # 13 free + 2 evicted, tail first
    assert evicted == [pages[2], pages[1]] and cache.num_evictions == 2
    assert cache.match(tokens) == pages[:1]
    cache.allocator.free(other, "x")


def test_held_cached_pages_survive_pressure(cache):
    tokens = list(range(8))
    pages, _ = run(cache, "a", [*tokens, 8])
    with pytest.raises(OutOfPages):
        cache.allocator.alloc(14, "x")  # 13 free, a's 3 pages held
    assert cache.num_pages == 2
    cache.allocator.free(pages, "a")


def test_clear_empties_the_cache_and_frees_idle_pages(cache):
    pages_a, _ = run(cache, "a", list(range(9)))
    pages_b, _ = run(cache, "b", list(range(100, 109)))
    cache.allocator.free(pages_a, "a")
    assert cache.clear() == 4
    assert cache.num_pages == 0 and cache.match(list(range(9))) == []
    assert cache.allocator.num_free == 13  # b still holds its 3 pages, now uncached
    cache.allocator.free(pages_b, "b")
    assert cache.allocator.num_free == 16
    assert run(cache, "c", list(range(9)))[1] == 0  # after a reset nothing hits
    cache.allocator.free(cache.allocator.pages_of("c"), "c")


def test_integrity_catches_a_key_without_a_cached_page(cache):
    pages = cache.allocator.alloc(1, "a")
    cache._key_of[pages[0]] = b"k"
    cache._page_of[b"k"] = pages[0]
    with pytest.raises(AllocatorError, match="disagree"):
        cache.check_integrity()
    cache._key_of.clear()
    cache._page_of.clear()
    cache.allocator.free(pages, "a")


def test_a_cached_pages_checksum_is_computed_once_while_it_stays_cached():
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, 2)
    pages = alloc.alloc(2, owner="r")
    cache.insert([1, 2, 3, 4], pages, 2)
    calls = []

    def compute(p):
        calls.append(p)
        return 100 + p + len(calls)

    first = cache.checksum(pages[0], compute)
    assert cache.checksum(pages[0], compute) == first and calls == [pages[0]]
    other = alloc.alloc(1, owner="s")[0]  # not cached: computed each time
    cache.checksum(other, compute), cache.checksum(other, compute)
    assert calls.count(other) == 2
    alloc.free(pages, owner="r")
    alloc.free([other], owner="s")
    alloc.alloc(4, owner="t")  # evicts both cached pages: their bytes may change now
    cache.insert([5, 6, 7, 8], alloc.pages_of("t")[:2], 2)
    assert cache.checksum(pages[0], compute) != first and calls.count(pages[0]) == 2
    cache.clear()
    cache.checksum(pages[0], compute)
    assert calls.count(pages[0]) == 3


def test_a_salted_request_shares_pages_only_with_its_own_salt(cache):
    tokens = list(range(10))
    a_pages, _ = run(cache, "a", tokens)  # unsalted
    # the same tokens under a salt: nothing found, its own pages cached beside the unsalted ones
    salted = cache.keys(tokens, "tenant-1")
    assert cache.match(tokens, keys=salted) == []
    hit = cache.acquire(tokens, "b", keys=salted)
    b_pages = hit + cache.allocator.alloc(3, "b")
    assert hit == [] and cache.insert(tokens, b_pages, 2, salted) == 2 and cache.num_pages == 4
    # the same salt finds them; another salt, or none, does not
    assert cache.match(tokens, keys=cache.keys(tokens, "tenant-1")) == b_pages[:2]
    assert cache.match(tokens, keys=cache.keys(tokens, "tenant-2")) == [] and cache.match(tokens) == a_pages[:2]
    # a salt's chain never collides with a page key of some token sequence: the root is
    # domain-separated, and the first page's key depends on it
    assert cache.keys(tokens, "x")[0] not in cache.keys(tokens) and cache.keys(tokens, "x") != cache.keys(tokens, "y")
    cache.allocator.free(a_pages, "a")
    cache.allocator.free(b_pages, "b")
