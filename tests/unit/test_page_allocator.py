import pytest

from services.engine.page_allocator import AllocatorError, OutOfPages, PageAllocator


@pytest.fixture
def alloc():
    a = PageAllocator(8)
    yield a
    a.check_integrity()  # after every test, whatever it did


def test_alloc_is_lowest_first_and_contiguous(alloc):
    assert alloc.alloc(3, owner="a") == [0, 1, 2]
    assert alloc.alloc(2, owner="b") == [3, 4]
    alloc.free([0, 1, 2], owner="a")
    assert alloc.alloc(4, owner="c") == [0, 1, 2, 5]
    assert alloc.num_free == 2 and alloc.num_used == 6


def test_over_allocation_raises_without_side_effects(alloc):
    alloc.alloc(6, owner="a")
    with pytest.raises(OutOfPages):
        alloc.alloc(3, owner="b")
    assert alloc.num_free == 2
    assert alloc.pages_of("b") == []


def test_double_free_detected(alloc):
    pages = alloc.alloc(2, owner="a")
    alloc.free(pages, owner="a")
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free(pages, owner="a")
    assert alloc.is_whole()


def test_free_by_wrong_owner_or_foreign_page_rejected_atomically(alloc):
    a_pages = alloc.alloc(2, owner="a")
    b_pages = alloc.alloc(1, owner="b")
    with pytest.raises(AllocatorError, match="belongs to"):
        alloc.free([a_pages[0], b_pages[0]], owner="a")
    assert alloc.pages_of("a") == a_pages  # nothing was freed
    with pytest.raises(AllocatorError, match="not a page"):
        alloc.free([99], owner="a")
    with pytest.raises(AllocatorError, match="duplicate"):
        alloc.free([a_pages[0], a_pages[0]], owner="a")
    alloc.free(a_pages, owner="a")
    alloc.free(b_pages, owner="b")
    assert alloc.is_whole()


def test_leak_detection(alloc):
    alloc.alloc(1, owner="live")
    alloc.alloc(2, owner="gone")
    assert alloc.leaked(live_owners={"live"}) == {"gone"}
    assert not alloc.is_whole()


def test_integrity_check_catches_corruption(alloc):
    pages = alloc.alloc(1, owner="a")
    alloc._free_set.add(pages[0])  # simulate a bug: page both used and free
    with pytest.raises(AllocatorError):
        alloc.check_integrity()
    alloc._free_set.discard(pages[0])
    alloc.free(pages, owner="a")


def test_zero_and_negative(alloc):
    assert alloc.alloc(0, owner="a") == []
    with pytest.raises(ValueError):
        alloc.alloc(-1, owner="a")
    with pytest.raises(ValueError):
        PageAllocator(0)


# --- refcounts: pages shared by holders and the prefix cache -------------------------------


def test_shared_page_is_freed_by_its_last_holder_only(alloc):
    pages = alloc.alloc(2, owner="a")
    alloc.mark_cached(pages[0])
    alloc.share([pages[0]], owner="b")
    assert alloc.holders_of(pages[0]) == {"a", "b"}
    alloc.free(pages, owner="a")
    assert alloc.num_used == 1 and alloc.num_free == 7  # page 1 free, page 0 still held by b
    alloc.free([pages[0]], owner="b")
    assert alloc.num_idle == 1 and alloc.num_available == 8 and alloc.is_whole()


def test_only_cached_pages_are_shared_and_share_is_atomic(alloc):
    pages = alloc.alloc(2, owner="a")
    alloc.mark_cached(pages[0])
    with pytest.raises(AllocatorError, match="not cached"):
        alloc.share(pages, owner="b")
    assert alloc.holders_of(pages[0]) == {"a"}  # nothing shared
    with pytest.raises(AllocatorError, match="already held"):
        alloc.share([pages[0]], owner="a")
    alloc.free(pages, owner="a")


def test_idle_cached_pages_are_evicted_oldest_first_only_when_needed(alloc):
    evicted = []
    alloc.on_evict = evicted.append
    seq = alloc.alloc(3, owner="a")
    for p in seq:
        alloc.mark_cached(p)
    alloc.free(seq, owner="a")  # let go tail first: page 2 is the oldest idle page
    assert alloc.num_idle == 3 and alloc.num_free == 5
    assert alloc.alloc(5, owner="b") == [3, 4, 5, 6, 7]
    assert evicted == []  # the free heap sufficed
    assert alloc.alloc(2, owner="c") == [1, 2]
    assert evicted == [2, 1] and alloc.num_idle == 1 and alloc.is_cached(0)
    with pytest.raises(OutOfPages):
        alloc.alloc(2, owner="d")
    assert alloc.num_idle == 1 and evicted == [2, 1]  # no side effects
    alloc.free([1, 2], owner="c")
    alloc.free([3, 4, 5, 6, 7], owner="b")


def test_a_held_cached_page_is_never_evicted(alloc):
    pages = alloc.alloc(1, owner="a")
    alloc.mark_cached(pages[0])
    alloc.alloc(7, owner="b")
    with pytest.raises(OutOfPages):
        alloc.alloc(1, owner="c")
    alloc.free(pages, owner="a")
    assert alloc.alloc(1, owner="c") == pages  # idle now: evicted for c
    alloc.free(pages, owner="c")
    alloc.free(alloc.pages_of("b"), owner="b")
    assert alloc.is_whole() and alloc.num_idle == 0


def test_uncache_all_frees_idle_and_keeps_held(alloc):
    a = alloc.alloc(2, owner="a")
    b = alloc.alloc(1, owner="b")
    for p in (*a, *b):
        alloc.mark_cached(p)
    alloc.free(a, owner="a")
    assert sorted(alloc.uncache_all()) == [0, 1, 2]
    assert alloc.num_free == 7 and alloc.num_idle == 0 and not alloc.is_cached(b[0])
    alloc.free(b, owner="b")
    assert alloc.num_free == 8


def test_free_of_an_idle_page_and_mark_of_a_free_page_are_refused(alloc):
    pages = alloc.alloc(1, owner="a")
    alloc.mark_cached(pages[0])
    alloc.free(pages, owner="a")
    with pytest.raises(AllocatorError, match="no holder"):
        alloc.free(pages, owner="a")
    with pytest.raises(AllocatorError, match="not held"):
        alloc.mark_cached(5)


def test_integrity_check_catches_a_holderless_or_uncached_idle_page(alloc):
    pages = alloc.alloc(1, owner="a")
    alloc._holders[pages[0]].clear()
    with pytest.raises(AllocatorError, match="no holder"):
        alloc.check_integrity()
    alloc._holders[pages[0]].add("a")
    alloc.free(pages, owner="a")
    alloc._free_set.discard(pages[0])
    alloc._free_heap.remove(pages[0])
    alloc._idle[pages[0]] = None  # idle but not cached
    with pytest.raises(AllocatorError, match="disagree"):
        alloc.check_integrity()
    del alloc._idle[pages[0]]
    alloc._to_heap(pages[0])
