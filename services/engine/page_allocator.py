"""KV page allocator: pure Python bookkeeping, no torch, so it unit-tests in microseconds.

Pages are handed out lowest-id first. That keeps a request's pages mostly contiguous, and
contiguous page runs become single NIXL descriptors (see services/engine/kv_pool.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable


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
        self._owner_of: dict[int, Hashable] = {}

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_used(self) -> int:
        return len(self._owner_of)

    def alloc(self, n: int, owner: Hashable) -> list[int]:
        """Take n pages for owner (a room id); raises OutOfPages without side effects."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} of {self.num_total} free")
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._free_set.discard(p)
            self._owner_of[p] = owner
        return pages

    def free(self, pages: Iterable[int], owner: Hashable) -> None:
        """Return pages; every page must currently belong to owner (else nothing is freed)."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise AllocatorError(f"duplicate page ids in free: {pages}")
        for p in pages:
            if p in self._free_set:
                raise AllocatorError(f"double free of page {p}")
            if p not in self._owner_of:
                raise AllocatorError(f"page {p} is not a page of this pool")
            if self._owner_of[p] != owner:
                raise AllocatorError(f"page {p} belongs to {self._owner_of[p]!r}, not {owner!r}")
        for p in pages:
            del self._owner_of[p]
            self._free_set.add(p)
            heapq.heappush(self._free_heap, p)

    def owners(self) -> set[Hashable]:
        return set(self._owner_of.values())

    def pages_of(self, owner: Hashable) -> list[int]:
        return sorted(p for p, o in self._owner_of.items() if o == owner)

    def leaked(self, live_owners: Iterable[Hashable]) -> set[Hashable]:
        """Owners that still hold pages but are no longer live: a leak."""
        return self.owners() - set(live_owners)

    def check_integrity(self) -> None:
        """free + used == total, and no page is both free and used."""
        if self._free_set & self._owner_of.keys():
            raise AllocatorError("a page is both free and in use")
        if len(self._free_set) + len(self._owner_of) != self.num_total:
            raise AllocatorError(
                f"free {len(self._free_set)} + used {len(self._owner_of)} != total {self.num_total}"
            )
        if len(self._free_heap) != len(self._free_set):
            raise AllocatorError("free heap and free set disagree")

    def is_whole(self) -> bool:
        """True when every page is free (what tests assert after each scenario)."""
        self.check_integrity()
        return self.num_free == self.num_total
