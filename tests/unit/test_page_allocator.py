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
