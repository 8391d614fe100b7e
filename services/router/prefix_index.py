"""The router's approximate view of each worker's prefix cache, kept from its own routing.

What it holds: per worker, the chain keys of the full pages this router sent it — a request's
prompt when it is routed there, and on decode also the reply once the request finished (decode
keeps prompt + reply cached, services/decode/worker.py `_keep_cached`). The keys are the
workers' own (services/engine/prefix_cache.py `page_keys`: BLAKE2b of the previous key and the
page's token ids), computed with the page size each worker reports in its Load reply, so a
match here predicts the hit the worker will find: `match` counts the leading pages of a
request that the worker was sent, i.e. the prefix it should still hold.

Why the same hash chain rather than a radix tree over tokens (as SGLang's router keeps): the
workers cache whole pages only, so a match inside a page is worth nothing to them; one dict
probe per page answers "does this worker hold the prefix up to here" because a chain key names
its whole prefix; and there is no tree to split or merge. The keys are computed once per
request and reused for both roles and for the insert.

Approximate, on purpose: it never asks the workers. It misses what other routers (or the
router's other processes, --processes) sent, it cannot see the worker evict under memory
pressure, and it counts a prompt as sent even if the request then failed. A wrong guess costs
only a miss (the worker computes more); the hit the client sees is the worker's
(`usage.prompt_tokens_details.cached_tokens`). What would make it wrong for long is handled:
a worker that restarts (a new epoch in its Load reply) or is ejected loses its entries
(services/router/pool.py), and POST /reset_prefix_cache clears them all.

Bounded memory: each worker keeps at most `max_pages` keys (--prefix-index-max-pages), and no
more than its KV pool holds pages (a worker cannot cache more than that); beyond it the least
recently routed keys go. A chain is touched from its last page back to its first, so the first
pages of a conversation are the most recent and go last: what eviction leaves is still a prefix
(like a radix tree evicting leaves first), and `match`, which stops at the first missing key,
keeps matching it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from services.engine.prefix_cache import chain_root, page_keys


class RequestKeys:
    """One request's page keys, computed once per page size (workers normally share one), under
    its cache_salt and LoRA adapter as the workers compute them."""

    def __init__(self, token_ids: Sequence[int], salt: str = "", lora: str = ""):
        self.token_ids = token_ids
        self.salt = salt
        self.lora = lora
        self._root = chain_root(salt, lora)
        self._by_page_size: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def for_page_size(self, page_size: int) -> list[bytes]:
        keys = self._by_page_size.get(page_size)
        if keys is None:
            keys = self._by_page_size[page_size] = page_keys(self.token_ids, page_size, parent=self._root)
        return keys

    def extended(self, token_ids: Sequence[int]) -> RequestKeys:
        """The keys of a longer sequence that starts with this one (the prompt + its reply): only
        the new pages are hashed, the ones computed here are reused."""
        if list(token_ids[: len(self.token_ids)]) != list(self.token_ids):
            return RequestKeys(token_ids, self.salt, self.lora)
        longer = RequestKeys(token_ids, self.salt, self.lora)
        for page_size, keys in self._by_page_size.items():
            longer._by_page_size[page_size] = keys + page_keys(
                token_ids, page_size, start=len(keys), parent=keys[-1] if keys else self._root)
        return longer


class PrefixIndex:
    def __init__(self, max_pages: int):
        if max_pages < 1:
            raise ValueError(f"max_pages must be at least 1, got {max_pages}")
        self.max_pages = max_pages
        self._entries: dict[Hashable, OrderedDict[bytes, None]] = {}  # per worker, least recent first

    def pages(self, worker: Hashable) -> int:
        entries = self._entries.get(worker)
        return len(entries) if entries else 0

    def match(self, worker: Hashable, keys: Sequence[bytes]) -> int:
        """How many leading pages of `keys` the worker was sent (and has not been forgotten)."""
        entries = self._entries.get(worker)
        if not entries:
            return 0
        n = 0
        for key in keys:
            if key not in entries:
                break
            n += 1
        return n

    def insert(self, worker: Hashable, keys: Sequence[bytes], cap: int | None = None) -> None:
        """The worker now holds `keys` (a chain from the first page). `cap`: the worker's own
        limit in pages (its KV pool), when smaller than max_pages."""
        if not keys:
            return
        entries = self._entries.setdefault(worker, OrderedDict())
        for key in reversed(keys):  # the first page ends up most recent: eviction keeps a prefix
            entries[key] = None
            entries.move_to_end(key)
        limit = min(self.max_pages, cap) if cap else self.max_pages
        while len(entries) > limit:
            entries.popitem(last=False)

    def forget(self, worker: Hashable) -> int:
        """Drop every entry of the worker (restarted, ejected, left the pool); returns how many."""
        entries = self._entries.pop(worker, None)
        return len(entries) if entries else 0

    def clear(self) -> int:
        dropped = sum(len(e) for e in self._entries.values())
        self._entries.clear()
        return dropped
