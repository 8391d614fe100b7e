"""The prefix cache: full KV pages found again by the token ids that produced them (no torch).

Each full page has a key that chains its page_size token ids to the key of the page before it
(a hash chain, as vLLM's automatic prefix caching): key_i = H(key_{i-1} || tokens of page i).
A key therefore names the whole prefix up to the end of its page, so equal keys mean equal KV
(same model, same positions). Lookup walks the prompt's keys from the first page and stops at
the first one not cached: the hit is always a prefix.

Why a hash chain rather than a radix tree (SGLang): a page is the unit every other part of
pdmesh moves and frees (allocation, NIXL descriptors, quarantine), and a chain key per page
maps one to one onto it; there is no node to split when prompts diverge inside a page (the
partial page is simply not shared), lookups are a dict probe per page, and the same key can be
computed anywhere from token ids alone (decode, the router) without the tree. What it gives up
(matching inside a page) is at most page_size - 1 tokens per request.

The keys are BLAKE2b digests (16 bytes) of the previous key and the tokens' bytes, so two
different prefixes never share a page in practice, whatever the tokens are.

A request with vLLM's `cache_salt` starts its chain from a digest of the salt instead of the
empty root (`chain_root`): its pages are found again only by requests with the same salt and
the same tokens, so a tenant that keeps its salt secret cannot learn from a cache hit (or its
timing) what another tenant's prompts were. Nothing else changes: a salted key is a key. A
request computed with a LoRA adapter starts from a digest of the adapter's name (and its salt):
the same tokens give other KV under another adapter.

The allocator (services/engine/page_allocator.py) keeps each page's holders and the LRU order
of idle cached pages; this module keeps the keys. They agree at all times (`check_integrity`):
a page is cached iff it has a key here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Hashable, Sequence

from services.engine.page_allocator import AllocatorError, PageAllocator

ROOT = b""


def chain_root(salt: str, lora: str = "") -> bytes:
    """Where a request's chain starts: ROOT unsalted on the base model, else a digest of its
    cache_salt and LoRA adapter (domain-separated, so no root equals a page key of some token
    sequence, and no salt spells an adapter: the name's length leads it)."""
    if not lora:
        if not salt:
            return ROOT
        return hashlib.blake2b(b"pdmesh cache_salt\0" + salt.encode(), digest_size=16).digest()
    name = lora.encode()
    return hashlib.blake2b(b"pdmesh lora\0" + len(name).to_bytes(4, "little") + name + salt.encode(),
                           digest_size=16).digest()


def page_keys(token_ids: Sequence[int], page_size: int, num_pages: int | None = None, start: int = 0,
              parent: bytes = ROOT) -> list[bytes]:
    """The chain keys of the first `num_pages` full pages of token_ids (default: all full pages).
    `start`, `parent`: only the keys of pages start.. , given the key of page start - 1 (extending
    a chain already computed for a shorter sequence with the same first pages)."""
    full = len(token_ids) // page_size
    n = full if num_pages is None else min(full, num_pages)
    keys = []
    for i in range(start, n):
        chunk = array("I", token_ids[i * page_size : (i + 1) * page_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.num_evictions = 0
        self.query_tokens = 0  # prompt tokens looked up (`record`), and of those found cached
        self.hit_tokens = 0
        self.on_evicted: Callable[[int], None] | None = None  # metrics: one call per evicted page
        # a cached page's KV checksum, computed once (`checksum`): its bytes cannot change while it
        # is cached (nobody writes a cached page), so the value holds until it leaves the cache
        self._checksums: dict[int, int] = {}
        allocator.on_evict = self._forget

    @property
    def num_pages(self) -> int:
        return len(self._key_of)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """One request's lookup took effect (its pages were allocated): count it."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def max_hit_pages(self, num_tokens: int) -> int:
        """A hit leaves at least one prompt token to compute: its logits give the first token,
        and its KV goes into a page of the request's own, never into a shared one."""
        return max(0, num_tokens - 1) // self.page_size

    def keys(self, token_ids: Sequence[int], salt: str = "", lora: str = "") -> list[bytes]:
        """Every full page's key (under the request's cache_salt and LoRA adapter): computed once
        per sequence, passed to match/insert."""
        return page_keys(token_ids, self.page_size, parent=chain_root(salt, lora))

    def match(self, token_ids: Sequence[int], max_pages: int | None = None, keys: list[bytes] | None = None) -> list[int]:
        """The cached pages of the longest cached prefix of token_ids (full pages only), at most
        max_pages (default: max_hit_pages). Takes no reference: `acquire` does. `keys`: the
        sequence's keys (`keys()`, under its salt); else its unsalted ones."""
        limit = self.max_hit_pages(len(token_ids)) if max_pages is None else max_pages
        pages = []
        for key in (page_keys(token_ids, self.page_size, limit) if keys is None else keys[:limit]):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, token_ids: Sequence[int], owner: Hashable, max_pages: int | None = None,
                keys: list[bytes] | None = None) -> list[int]:
        """match + the owner becomes a holder of the hit pages (so nothing evicts them)."""
        pages = self.match(token_ids, max_pages, keys)
        self.allocator.share(pages, owner)
        return pages

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], num_full_pages: int,
               keys: list[bytes] | None = None) -> int:
        """The first num_full_pages pages of a sequence now hold complete KV for token_ids:
        cache those not cached yet. A key already cached under another page (the same prefix
        computed twice at once) keeps that page; this one stays the sequence's own. Returns
        the pages newly cached. `keys`: the sequence's keys (`keys()`, under its salt); else its
        unsalted ones."""
        added = 0
        n = min(num_full_pages, len(pages))
        keys = page_keys(token_ids, self.page_size, n) if keys is None else keys[:n]
        for key, page in zip(keys, pages, strict=False):
            if key in self._page_of:
                continue  # cached already: this very page (a hit), or another with the same KV
            if page in self._key_of:
                raise AllocatorError(f"page {page} is cached under another prefix")
            self.allocator.mark_cached(page)
            self._page_of[key] = page
            self._key_of[page] = key
            added += 1
        return added

    def checksum(self, page: int, compute: Callable[[int], int]) -> int:
        """compute(page) — the page's KV checksum — once per stay of the page in the cache (decode
        offers its held prefix with one per page every round: without this, each round would hash
        the whole context again). A page not cached is computed every time."""
        if page not in self._key_of:
            return compute(page)
        value = self._checksums.get(page)
        if value is None:
            value = self._checksums[page] = compute(page)
        return value

    def clear(self) -> int:
        """Forget every entry (reset_prefix_cache): idle pages go free, held ones stay with
        their holders as ordinary pages. Returns the number of entries dropped."""
        n = len(self._key_of)
        self.allocator.uncache_all()
        self._page_of.clear()
        self._key_of.clear()
        self._checksums.clear()
        return n

    def check_integrity(self) -> None:
        """The allocator's integrity, and: a page is cached there iff it has a key here, one key
        per page and one page per key."""
        self.allocator.check_integrity()
        if len(self._page_of) != len(self._key_of):
            raise AllocatorError("prefix cache keys and pages disagree")
        if any(self._key_of.get(p) != k for k, p in self._page_of.items()):
            raise AllocatorError("prefix cache key -> page and page -> key disagree")
        if self.allocator.num_cached != len(self._key_of) or not all(map(self.allocator.is_cached, self._key_of)):
            raise AllocatorError("prefix cache and allocator disagree on which pages are cached")

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        self._checksums.pop(page, None)
        if key is not None:
            del self._page_of[key]
        self.num_evictions += 1
        if self.on_evicted is not None:
            self.on_evicted(page)
