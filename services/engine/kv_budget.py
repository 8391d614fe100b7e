"""How many KV pages a worker allocates, with vLLM's controls.

In order of precedence:
- `--num-pages N` (> 0): exactly N pages, the explicit override.
- `--kv-cache-memory-bytes B` (> 0): as many pages as fit in B bytes, on any device.
- on CUDA, `--gpu-memory-utilization U` (vLLM's meaning: the fraction of the device's memory this
  worker may use for weights, activations and KV together): U x total memory, less what the
  device already holds once the weights are loaded (this process's and any other's), less an
  activation reserve for one forward of `--chunked-prefill-size` tokens.
- otherwise (CPU without a budget): DEFAULT_CPU_PAGES.

The result is logged in tokens at start (`kv cache sized`), with the max model length it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model_config import ModelConfig

DEFAULT_CPU_PAGES = 4096
# Activations of one forward, per token of the chunk: hidden states, q/k/v, MLP intermediates and
# the logits of the last positions, in the model's dtype, with a factor for the allocator's slack.
ACTIVATION_SLACK = 4


@dataclass(frozen=True)
class KVBudget:
    pages: int
    source: str  # "num-pages" | "kv-cache-memory-bytes" | "gpu-memory-utilization" | "cpu-default"
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of every layer for page_size tokens (services/engine/kv_pool.py)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * page_size * config.num_key_value_heads * config.head_dim * itemsize


def activation_reserve(config: ModelConfig, chunk_tokens: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * config.hidden_size + 2 * config.intermediate_size) * itemsize
    return ACTIVATION_SLACK * chunk_tokens * per_token + config.vocab_size * 4 * 64


def size_pool(config: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device, *, num_pages: int = 0,
              kv_cache_memory_bytes: int = 0, gpu_memory_utilization: float = 0.9,
              chunk_tokens: int = 512) -> KVBudget:
    """Raises ValueError when the budget cannot hold a single page."""
    one = page_bytes(config, page_size, dtype)
    if num_pages > 0:
        return KVBudget(num_pages, "num-pages", one)
    if kv_cache_memory_bytes > 0:
        return KVBudget(_pages(kv_cache_memory_bytes, one, "--kv-cache-memory-bytes"), "kv-cache-memory-bytes", one)
    if device.type == "cuda":
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - activation_reserve(config, chunk_tokens, dtype)
        return KVBudget(_pages(budget, one, "--gpu-memory-utilization"), "gpu-memory-utilization", one)
    return KVBudget(DEFAULT_CPU_PAGES, "cpu-default", one)


def _pages(budget: int, one: int, flag: str) -> int:
    pages = budget // one
    if pages < 1:
        raise ValueError(f"{flag} leaves {max(budget, 0)} bytes for the KV cache, less than one page ({one} bytes)")
    return pages
