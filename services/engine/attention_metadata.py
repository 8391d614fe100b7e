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
class FreshBatch:
    """Fresh prompts (start_pos 0) that attend together in one stacked call, padded to the
    longest. Their whole context is the chunk at hand, so no cache read is needed."""

    spans: list[PrefillSeqSpan]
    rows: torch.Tensor  # [B, L] row of each (sequence, position) in the packed batch (pad: row 0)
    mask: torch.Tensor | None  # [B, 1, L, L] causal and not padding; None when all are length L


# Padding costs compute: a prompt joins a group only if the group's longest prompt is at most
# this many times its length (it then pads by at most half its own length).
MAX_PADDED_LENGTH_RATIO = 1.5


def group_fresh_spans(
    spans: list[PrefillSeqSpan], max_ratio: float = MAX_PADDED_LENGTH_RATIO
) -> list[list[PrefillSeqSpan]]:
    """Fresh spans grouped for stacked attention, longest first; singletons are left out
    (they attend alone). max_ratio 0 groups nothing."""
    fresh = sorted((s for s in spans if s.start_pos == 0), key=lambda s: -s.num_tokens)
    groups: list[list[PrefillSeqSpan]] = []
    for span in fresh:
        if groups and groups[-1][0].num_tokens <= max_ratio * span.num_tokens:
            groups[-1].append(span)
        else:
            groups.append([span])
    return [g for g in groups if len(g) > 1]


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute positions of the packed tokens
    write_page: torch.Tensor  # [T] page each token's K/V is stored into
    write_off: torch.Tensor  # [T]
    # Prefill: one span per sequence (equal-length fresh prompts attend stacked, others one by one).
    spans: list[PrefillSeqSpan] | None = None
    fresh_batches: list[FreshBatch] | None = None
    # Decode: one token per sequence, context padded to the longest: [B, S_max].
    decode_page: torch.Tensor | None = None
    decode_off: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.decode_page is not None
