"""The paged KV cache: one tensor per worker, allocated once and registered with NIXL once.

Layout: ``[num_pages, num_layers, 2 (k, v), page_size, num_kv_heads, head_dim]`` — page-major.

Why page-major: a page holds the K and V of *every* layer for page_size consecutive tokens in
one contiguous block of memory. A request's KV is therefore a set of whole pages, and a run of
consecutive page ids is one contiguous byte range: one NIXL descriptor per run, independent of
the number of layers. A layer-major layout (vLLM/SGLang style) needs 2 x layers descriptors per
run instead (64 per run for a 32-layer model). The cost is that one layer's pages are strided
in memory, which attention handles with a gather (advanced indexing) anyway.

Next to the pages sits a small *aux* buffer: one int64 row per slot, carrying what travels with
the KV (room id, first token id, its logprob, sender epoch, prompt tokens prefill found in its
prefix cache, how many KV pages the WRITE carries, and the KV checksum of those pages and of
the words before it: services/transfer/kv_checksum.py), also sent over NIXL.
"""

from __future__ import annotations

import torch

from services.engine.model_config import ModelConfig
from services.engine.page_allocator import PageAllocator

# aux row layout (int64 words); the logprob is a float64 stored bit-for-bit.
AUX_ROOM, AUX_TOKEN, AUX_LOGPROB_BITS, AUX_EPOCH, AUX_CACHED, AUX_SENT_PAGES, AUX_CHECKSUM = 0, 1, 2, 3, 4, 5, 6
AUX_WORDS = 7


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        num_aux_slots: int | None = None,
    ):
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv = torch.zeros(
            num_pages,
            config.num_hidden_layers,
            2,
            page_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype=dtype,
            device=self.device,
        )
        # Aux rows stay in host memory: they are tiny and read by the CPU (scheduler) side.
        self.aux = torch.zeros(num_aux_slots or num_pages, AUX_WORDS, dtype=torch.int64)
        self.allocator = PageAllocator(num_pages)
        self.aux_allocator = PageAllocator(self.aux.shape[0])
        self._page_bytes = None  # page_run_bytes' view of a host pool, made on first use

    # --- sizes and addresses (what the transfer layer describes to NIXL) -------------------
    @property
    def page_nbytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    @property
    def aux_row_nbytes(self) -> int:
        return self.aux[0].numel() * self.aux.element_size()

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether the whole pool is large enough for one sequence of num_tokens."""
        return self.pages_for_tokens(num_tokens) <= self.num_pages

    @property
    def token_usage(self) -> float:
        """Fraction of pages in use (SGLang's token_usage gauge)."""
        return self.allocator.num_used / self.num_pages

    def page_run_bytes(self, first: int, count: int):
        """The bytes of pages first..first+count-1 (one contiguous run of the page-major tensor) as a
        buffer the KV checksum can read: a view of host memory, a host copy of device memory."""
        if self.kv.device.type != "cpu":
            return self.kv[first : first + count].reshape(-1).view(torch.uint8).cpu().numpy()
        if self._page_bytes is None:  # one numpy view of the whole pool: slicing it costs ~1 µs a run
            self._page_bytes = self.kv.view(self.num_pages, -1).view(torch.uint8).numpy()
        return self._page_bytes[first : first + count]

    # --- per-layer access used by attention -------------------------------------------------
    def write(self, layer: int, slots_page: torch.Tensor, slots_off: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k/v ``[T, kv_heads, head_dim]`` for T tokens at (page, offset) pairs."""
        self.kv[slots_page, layer, 0, slots_off] = k.to(self.dtype)
        self.kv[slots_page, layer, 1, slots_off] = v.to(self.dtype)

    def gather(self, layer: int, page_idx: torch.Tensor, off_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read k/v at index tensors of any shape S -> ``[*S, kv_heads, head_dim]``."""
        layer_kv = self.kv[:, layer]
        return layer_kv[page_idx, 0, off_idx], layer_kv[page_idx, 1, off_idx]
