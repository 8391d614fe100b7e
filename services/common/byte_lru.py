"""An LRU cache bounded by bytes, keyed by a hash of the source it was computed from.

Grammar caches must not keep whole sources: a request may carry megabytes of schema, and a cache
bounded by entries alone (512 of them) could hold gigabytes. Keys here are a SHA-256 digest of the
source (32 bytes), and each value is charged what it holds (`cost`), so the cache never holds more
than `budget` bytes, however large or many the sources are. Thread-safe (the router validates on
the loop and on parse threads; workers compile on the engine thread and the loop).
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Hashable
from typing import Any

KEY_BYTES = 32  # a SHA-256 digest
ENTRY_OVERHEAD_BYTES = 200  # the dict slot, the digest object, the cost: charged to every entry


def source_key(*parts: str) -> bytes:
    """The digest of a (kind, source, ...) tuple; parts are separated so ("a", "bc") != ("ab", "c")."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class ByteLRU:
    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0  # what the entries are charged, in all
        self._entries: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return default
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: Any, cost: int) -> None:
        """Keep `value`, charged `cost` bytes (plus the key and overhead); older entries leave
        until the budget holds. A value costing more than the whole budget is not kept."""
        charge = cost + KEY_BYTES + ENTRY_OVERHEAD_BYTES
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if charge > self.budget:
                return
            self._entries[key] = (value, charge)
            self.bytes += charge
            while self.bytes > self.budget:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries
