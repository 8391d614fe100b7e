"""Where each token of a forward pass reads and writes the paged KV cache.

Built once per forward (not per layer) by the runner from the requests' page tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeqSpan:
    start: int  # first row of this sequence in the packed token batch
    num_tokens: int  # tokens of this chunk
    gather_page: torch.Tensor  # [ctx] page id of every context token (cached + this chunk)
    gather_off: torch.Tensor  # [ctx] offset inside the page
    mask: torch.Tensor  # [num_tokens, ctx] bool, causal relative to the chunk's start position
    start_pos: int = 0  # tokens of this sequence cached before the chunk (0: a fresh prompt)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute positions of the packed tokens
    write_page: torch.Tensor  # [T] page each token's K/V is stored into
    write_off: torch.Tensor  # [T]
    # Prefill: one span per sequence (equal-length fresh prompts attend stacked, others one by one).
    spans: list[PrefillSeqSpan] | None = None
    # Decode: one token per sequence, context padded to the longest: [B, S_max].
    decode_page: torch.Tensor | None = None
    decode_off: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.decode_page is not None
