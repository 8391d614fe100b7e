"""The KV checksum: what prefill sends for a room, hashed so decode can tell wrong KV from right.

xxHash's XXH3-64 (the `xxhash` package) over the room's KV pages in token order — consecutive
page ids hashed as one contiguous run — followed by the aux row's payload words (everything but
the checksum itself). Prefill computes it over its source pages after the forward, just before
posting the WRITE; decode computes it over its destination pages after the WRITE's notification
and compares before the room's first step. Pages in the wrong place, bytes flipped in flight or
in memory, a short write: the digests differ, the room fails with DATA_LOSS before any token
leaves, and the router fails over to another pair.

Why XXH3-64: it is not a cryptographic hash (nothing here defends against an attacker who can
write into decode's memory; the internal token and the network do that); it is a well-kept
library that hashes at memory bandwidth on one core (docs/bench.md), so checking costs a small
fraction of moving the same bytes; 64 bits make an undetected random corruption ~2^-64.

Pure: no torch, no nixl. The bytes come from the caller's `read_run` (KVPool.page_run_bytes gives a
buffer per run; on CUDA that is a host copy of the run — the same library over a staging copy,
simpler than a device-side reduction and exact; its cost is measured in docs/bench.md).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence

import xxhash

NONE = 0  # the aux row's checksum word when the sender computed none (--kv-checksum off)


def runs(pages: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(first page, count) of each run of consecutive page ids, in order."""
    i = 0
    while i < len(pages):
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1:
            j += 1
        yield pages[i], j - i
        i = j


def kv_checksum(read_run: Callable[[int, int], object], pages: Sequence[int], words: Sequence[int]) -> int:
    """The digest of `pages` (read through read_run(first, count) -> buffer) then `words`, as a
    non-zero signed int64 (what an aux row word holds; 0 means "none")."""
    h = xxhash.xxh3_64()
    for first, count in runs(pages):
        h.update(read_run(first, count))
    h.update(struct.pack(f"<{len(words)}q", *words))
    value = struct.unpack("<q", h.digest()[:8])[0]
    return value or 1  # 0 is reserved for "no checksum"
