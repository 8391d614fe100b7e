import torch

from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.runner import ModelRunner, PrefillItem


def test_page_major_layout_keeps_a_page_contiguous():
    lm = load_model(None)
    pool = KVPool(lm.config, num_pages=8, page_size=4)
    cfg = lm.config
    assert pool.page_nbytes == cfg.num_hidden_layers * 2 * 4 * cfg.num_key_value_heads * cfg.head_dim * 4
    # consecutive pages are adjacent in memory: a run of pages is one byte range
    assert pool.kv[1].data_ptr() - pool.kv[0].data_ptr() == pool.page_nbytes
    pages = pool.allocator.alloc(2, owner="r")
    ModelRunner(lm.model, pool).prefill([PrefillItem(list(range(6)), 0, [pages[1], pages[0]])])
    # 6 tokens at page_size 4: the first page of the table is full, the second half full, the rest zero
    assert pool.kv[pages[1]].abs().sum() > 0
    assert pool.kv[pages[0], :, :, :2].abs().sum() > 0
    assert torch.count_nonzero(pool.kv[pages[0], :, :, 2:]) == 0
    assert torch.count_nonzero(pool.kv[2:]) == 0  # nothing written outside the request's pages
    pool.allocator.free(pages, owner="r")
    assert pool.allocator.is_whole()
    assert pool.token_usage == 0.0
