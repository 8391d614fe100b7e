"""The KV pool's size from vLLM's controls, and --max-model-len on a worker's engine."""

from __future__ import annotations

import pytest
import torch

from services.common.config import DecodeSettings, parse_settings
from services.common.sampling_params import SamplingParams
from services.common.wire import params_to_pb, parse_request
from services.engine.builtin_model import builtin_config
from services.engine.kv_budget import DEFAULT_CPU_PAGES, page_bytes, size_pool
from services.engine.worker_engine import WorkerEngine

CPU = torch.device("cpu")


def test_page_bytes_is_the_pool_layout():
    cfg = builtin_config()
    one = page_bytes(cfg, 16, torch.float32)
    assert one == cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert page_bytes(cfg, 16, torch.bfloat16) * 2 == one


def test_precedence_num_pages_then_bytes_then_default():
    cfg = builtin_config()
    one = page_bytes(cfg, 16, torch.float32)
    assert size_pool(cfg, 16, torch.float32, CPU, num_pages=7, kv_cache_memory_bytes=10**9).pages == 7
    b = size_pool(cfg, 16, torch.float32, CPU, kv_cache_memory_bytes=10 * one + one // 2)
    assert (b.pages, b.source, b.nbytes) == (10, "kv-cache-memory-bytes", 10 * one)
    assert size_pool(cfg, 16, torch.float32, CPU).pages == DEFAULT_CPU_PAGES
    with pytest.raises(ValueError, match="less than one page"):
        size_pool(cfg, 16, torch.float32, CPU, kv_cache_memory_bytes=one - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_utilization_leaves_the_rest_of_the_device():
    cfg = builtin_config()
    dev = torch.device("cuda:0")
    free, total = torch.cuda.mem_get_info(dev)
    b = size_pool(cfg, 16, torch.bfloat16, dev, gpu_memory_utilization=0.5)
    assert b.source == "gpu-memory-utilization"
    assert b.nbytes <= total * 0.5 - (total - free)


def test_engine_flags_size_the_pool_and_bound_requests():
    one = page_bytes(builtin_config(), 16, torch.float32)
    args = parse_settings(DecodeSettings, "decode", "", ["--model", "builtin-random", "--device", "cpu",
                                                          "--kv-cache-memory-bytes", str(12 * one),
                                                          "--max-model-len", "100"])
    engine = WorkerEngine.from_settings(args)
    try:
        assert engine.pool.num_pages == 12 and engine.capacity_tokens == 12 * 16
        assert engine.config.max_model_len == 100
        ok = params_to_pb(SamplingParams(max_tokens=40))
        parse_request(ok, list(range(60)), engine.config)
        with pytest.raises(ValueError, match="max model length 100"):
            parse_request(params_to_pb(SamplingParams(max_tokens=41)), list(range(60)), engine.config)
    finally:
        engine.shutdown()


def test_max_model_len_beyond_the_model_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        WorkerEngine("builtin-random", "cpu", "float32", 4, 16, max_model_len=10**6)
