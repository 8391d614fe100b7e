"""KV page allocator: pure Python bookkeeping, no torch, so it unit-tests in microseconds.

Pages are handed out lowest-id first. That keeps a request's pages mostly contiguous, and
contiguous page runs become single NIXL descriptors (see services/engine/kv_pool.py).

A page is in exactly one of three states (`check_integrity` says so):

  free     on the free heap; nobody reads it, nothing points at it
  held     one or more holders (rooms) use it; `alloc` gives a page one holder, `share` adds
           one (a prefix-cache hit), `free` removes one
  idle     cached (services/engine/prefix_cache.py keeps its key) and no holder: it keeps its
           KV for a later request, and `alloc` evicts it, least recently released first, only
           when the free heap alone cannot serve the request

A held page may also be cached: its last holder's `free` then makes it idle instead of free.
Only the cache marks pages cached (`mark_cached`) and only full pages whose KV is complete, so
every writer writes into pages it got from `alloc` and no other holder reads yet.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable


class AllocatorError(RuntimeError):
    """Misuse of the allocator: double free, foreign page, or broken integrity."""


class OutOfPages(AllocatorError):
    """Not enough free pages for the request; callers queue and retry."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_total = num_pages
        self._free_heap = list(range(num_pages))
        self._free_set = set(self._free_heap)
        self._holders: dict[int, set[Hashable]] = {}
        self._cached: set[int] = set()  # held or idle pages the prefix cache has a key for
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, no holder; oldest release first
        # called with each idle page `alloc` takes back, so the cache forgets its key
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages on the free heap (idle cached pages not counted)."""
        return len(self._free_set)

    @property
    def num_idle(self) -> int:
        """Cached pages no holder uses: evictable."""
        return len(self._idle)

    @property
    def num_available(self) -> int:
        """Pages `alloc` can hand out now: free ones, then idle cached ones it evicts."""
        return len(self._free_set) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages with at least one holder."""
        return len(self._holders)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def alloc(self, n: int, owner: Hashable) -> list[int]:
        """Take n pages for owner (a room id), evicting idle cached pages (least recently
        released first) only when the free heap is short; raises OutOfPages without side effects."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > self.num_available:
            raise OutOfPages(f"need {n} pages, {self.num_available} of {self.num_total} available")
        while len(self._free_set) < n:
            self._evict_oldest()
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._free_set.discard(p)
            self._holders[p] = {owner}
        return pages

    def share(self, pages: Iterable[int], owner: Hashable) -> None:
        """Add owner as a holder of cached pages (held by others, or idle); atomic on error."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise AllocatorError(f"duplicate page ids in share: {pages}")
        for p in pages:
            if p not in self._cached:
                raise AllocatorError(f"page {p} is not cached: only cached pages are shared")
            if owner in self._holders.get(p, ()):
                raise AllocatorError(f"page {p} is already held by {owner!r}")
        for p in pages:
            self._idle.pop(p, None)
            self._holders.setdefault(p, set()).add(owner)

    def free(self, pages: Iterable[int], owner: Hashable) -> None:
        """Owner lets go of pages (each must be held by owner, else nothing changes). A page
        nobody holds any more goes back to the heap, or stays idle when it is cached; a
        sequence's pages are let go last page first, so its tail is evicted before its head."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise AllocatorError(f"duplicate page ids in free: {pages}")
        for p in pages:
            if p in self._free_set:
                raise AllocatorError(f"double free of page {p}")
            if p not in self._holders:
                if p in self._idle:
                    raise AllocatorError(f"page {p} is cached with no holder: {owner!r} does not hold it")
                raise AllocatorError(f"page {p} is not a page of this pool")
            if owner not in self._holders[p]:
                raise AllocatorError(f"page {p} belongs to {sorted(map(repr, self._holders[p]))}, not {owner!r}")
        for p in reversed(pages):
            holders = self._holders[p]
            holders.discard(owner)
            if holders:
                continue
            del self._holders[p]
            if p in self._cached:
                self._idle[p] = None
            else:
                self._to_heap(p)

    # --- what the prefix cache calls --------------------------------------------------------
    def mark_cached(self, page: int) -> None:
        """The cache keeps page's KV under a key: when its last holder lets go it stays idle."""
        if page not in self._holders:
            raise AllocatorError(f"page {page} is not held: only a holder's complete page is cached")
        self._cached.add(page)

    def uncache_all(self) -> list[int]:
        """The cache forgets everything: idle pages go back to the heap, held ones become
        ordinary held pages. Returns the pages that were cached."""
        dropped = sorted(self._cached)
        for p in self._idle:
            self._to_heap(p)
        self._idle.clear()
        self._cached.clear()
        return dropped

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def holders_of(self, page: int) -> set[Hashable]:
        return set(self._holders.get(page, ()))

    # --- queries ----------------------------------------------------------------------------
    def owners(self) -> set[Hashable]:
        return {o for holders in self._holders.values() for o in holders}

    def pages_of(self, owner: Hashable) -> list[int]:
        return sorted(p for p, holders in self._holders.items() if owner in holders)

    def leaked(self, live_owners: Iterable[Hashable]) -> set[Hashable]:
        """Owners that still hold pages but are no longer live: a leak."""
        return self.owners() - set(live_owners)

    def check_integrity(self) -> None:
        """Every page is exactly one of free, held (by at least one holder) or idle; idle pages
        are cached; cached pages are held or idle; the free heap and set agree."""
        held = self._holders.keys()
        idle = self._idle.keys()
        if self._free_set & held or self._free_set & idle or held & idle:
            raise AllocatorError("a page is in two of free, held and idle")
        if len(self._free_set) + len(held) + len(idle) != self.num_total:
            raise AllocatorError(
                f"free {len(self._free_set)} + held {len(held)} + idle {len(idle)} != total {self.num_total}"
            )
        if any(not holders for holders in self._holders.values()):
            raise AllocatorError("a held page has no holder")
        if not idle <= self._cached or not self._cached <= (held | idle):
            raise AllocatorError("cached pages and held/idle pages disagree")
        if len(self._free_heap) != len(self._free_set):
            raise AllocatorError("free heap and free set disagree")

    def is_whole(self) -> bool:
        """True when no page has a holder: every page is free, or cached with no holder (what
        tests assert after each scenario)."""
        self.check_integrity()
        return not self._holders

    # --- internals --------------------------------------------------------------------------
    def _to_heap(self, page: int) -> None:
        self._free_set.add(page)
        heapq.heappush(self._free_heap, page)

    def _evict_oldest(self) -> None:
        page, _ = self._idle.popitem(last=False)
        self._cached.discard(page)
        self._to_heap(page)
        if self.on_evict is not None:
            self.on_evict(page)
