"""Descriptor building: a request's (src page, dst page) pairs → few contiguous byte ranges.

The KV pool is page-major (services/engine/kv_pool.py), so a run of consecutive page ids is
one contiguous byte range. A pair list is cut into runs where *both* the source and the
destination page ids advance by one, and each run becomes one (src, dst) descriptor pair.
Pure functions: no torch, no nixl.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageRun:
    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True)
class Desc:
    """One contiguous range copied from src_addr to dst_addr."""

    src_addr: int
    dst_addr: int
    nbytes: int


def coalesce_pages(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Runs of pairs (src_pages[i], dst_pages[i]) contiguous on both sides, in order."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    start = 0
    n = len(src_pages)
    for i in range(1, n + 1):
        if i == n or src_pages[i] != src_pages[i - 1] + 1 or dst_pages[i] != dst_pages[i - 1] + 1:
            runs.append(PageRun(src_pages[start], dst_pages[start], i - start))
            start = i
    return runs


def runs_to_descs(
    runs: Sequence[PageRun],
    src_base: int,
    dst_base: int,
    page_nbytes: int,
    max_desc_bytes: int | None = None,
) -> list[Desc]:
    """Byte ranges for runs; with max_desc_bytes, a run is split so no range exceeds it
    (never below one page)."""
    if page_nbytes <= 0:
        raise ValueError("page_nbytes must be positive")
    per_desc = None
    if max_desc_bytes is not None:
        per_desc = max(1, max_desc_bytes // page_nbytes)
    out: list[Desc] = []
    for r in runs:
        done = 0
        while done < r.count:
            k = r.count - done if per_desc is None else min(per_desc, r.count - done)
            out.append(
                Desc(
                    src_base + (r.src_start + done) * page_nbytes,
                    dst_base + (r.dst_start + done) * page_nbytes,
                    k * page_nbytes,
                )
            )
            done += k
    return out


def page_descs(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_base: int,
    dst_base: int,
    page_nbytes: int,
    max_desc_bytes: int | None = None,
) -> list[Desc]:
    """coalesce_pages + runs_to_descs."""
    return runs_to_descs(
        coalesce_pages(src_pages, dst_pages), src_base, dst_base, page_nbytes, max_desc_bytes
    )
