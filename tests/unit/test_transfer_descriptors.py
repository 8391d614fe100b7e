"""Descriptor coalescing: pure functions, no torch/nixl."""

import pytest

from services.transfer.descriptors import Desc, PageRun, coalesce_pages, page_descs, runs_to_descs


def test_fully_contiguous_is_one_run():
    assert coalesce_pages([3, 4, 5, 6], [10, 11, 12, 13]) == [PageRun(3, 10, 4)]


def test_breaks_where_either_side_breaks():
    # src breaks between 2 and 5; dst breaks between 13 and 20
    src = [0, 1, 2, 5, 6, 7]
    dst = [10, 11, 12, 13, 20, 21]
    assert coalesce_pages(src, dst) == [PageRun(0, 10, 3), PageRun(5, 13, 1), PageRun(6, 20, 2)]


def test_descending_or_repeated_ids_never_merge():
    assert coalesce_pages([5, 4], [1, 2]) == [PageRun(5, 1, 1), PageRun(4, 2, 1)]
    assert coalesce_pages([1, 2], [7, 7]) == [PageRun(1, 7, 1), PageRun(2, 7, 1)]


def test_empty_and_single():
    assert coalesce_pages([], []) == []
    assert coalesce_pages([9], [0]) == [PageRun(9, 0, 1)]


def test_length_mismatch_rejected():
    with pytest.raises(ValueError):
        coalesce_pages([1, 2], [1])


def test_runs_to_byte_ranges():
    runs = [PageRun(2, 0, 3), PageRun(9, 5, 1)]
    assert runs_to_descs(runs, 1000, 5000, 100) == [Desc(1200, 5000, 300), Desc(1900, 5500, 100)]


def test_max_desc_bytes_splits_runs_but_never_below_a_page():
    runs = [PageRun(0, 0, 5)]
    assert runs_to_descs(runs, 0, 0, 100, max_desc_bytes=250) == [
        Desc(0, 0, 200),
        Desc(200, 200, 200),
        Desc(400, 400, 100),
    ]
    assert [d.nbytes for d in runs_to_descs(runs, 0, 0, 100, max_desc_bytes=10)] == [100] * 5


def test_page_descs_covers_every_byte_once():
    src = [4, 5, 6, 1, 2, 8]
    dst = [0, 1, 3, 4, 5, 6]
    descs = page_descs(src, dst, 0, 10_000, 64)
    covered_src = sorted((d.src_addr + i) // 64 for d in descs for i in range(0, d.nbytes, 64))
    covered_dst = sorted((d.dst_addr - 10_000 + i) // 64 for d in descs for i in range(0, d.nbytes, 64))
    assert covered_src == sorted(src) and covered_dst == sorted(dst)
    # each pair maps src page -> dst page
    for d in descs:
        for i in range(0, d.nbytes, 64):
            s, t = (d.src_addr + i) // 64, (d.dst_addr - 10_000 + i) // 64
            assert dst[src.index(s)] == t
    assert len(descs) == 4  # [4,5]->[0,1], [6]->[3], [1,2]->[4,5], [8]->[6]
