"""Batched forward passes over the paged KV cache: prefill chunks and decode steps.

The runner is stateless about requests: callers (the schedulers) own page tables and
positions and hand them in. It only turns them into index tensors and runs the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.attention_metadata import (
    MAX_PADDED_LENGTH_RATIO,
    AttentionMetadata,
    FreshBatch,
    PrefillSeqSpan,
    group_fresh_spans,
)
from services.engine.kv_pool import KVPool
from services.engine.lora import LoraAdapters
from services.engine.model import CausalLM


@dataclass
class PrefillItem:
    token_ids: list[int]  # this chunk's tokens
    start_pos: int  # tokens of this sequence already in the cache
    page_table: list[int]  # must cover start_pos + len(token_ids) tokens
    lora: str = ""  # the LoRA adapter its request named ("": the base model)


@dataclass
class DecodeItem:
    token_id: int  # the last sampled token, not yet in the cache
    position: int  # its position (= tokens already cached)
    page_table: list[int]  # must cover position + 1 tokens
    lora: str = ""  # the LoRA adapter its request named ("": the base model)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, adapters: LoraAdapters | None = None):
        self.model = model
        self.adapters = adapters  # the LoRA adapters served (services/engine/lora.py); None: none
        self.pool = pool
        self.device = pool.device
        self.page_size = pool.page_size
        self.max_padded_length_ratio = MAX_PADDED_LENGTH_RATIO  # 0: every prompt attends alone

    def _check_capacity(self, page_table: list[int], num_tokens: int) -> None:
        if len(page_table) * self.page_size < num_tokens:
            raise ValueError(f"page table of {len(page_table)} pages cannot hold {num_tokens} tokens")

    def _slots(self, page_table: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        table = torch.tensor(page_table, dtype=torch.long)
        return table[pos // self.page_size], pos % self.page_size

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Run one chunk per item; returns float32 logits of each item's last token: [N, vocab]."""
        return self.prefill_rows(items)[0]

    @torch.inference_mode()
    def prefill_rows(self, items: list[PrefillItem], every_row: Sequence[int] = ()
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """prefill(), plus the logits of every row of the items indexed by `every_row` (prompt
        logprobs): ({index: [len(chunk), vocab]}). At most one chunk's rows per item: the chunk
        budget bounds what is materialized."""
        ids, positions, w_page, w_off, spans, last_rows = [], [], [], [], [], []
        row = 0
        for item in items:
            n = len(item.token_ids)
            if n == 0:
                raise ValueError("empty prefill chunk")
            ctx = item.start_pos + n
            self._check_capacity(item.page_table, ctx)
            g_page, g_off = self._slots(item.page_table, 0, ctx)
            ids.extend(item.token_ids)
            positions.append(torch.arange(item.start_pos, ctx))
            w_page.append(g_page[item.start_pos :])
            w_off.append(g_off[item.start_pos :])
            # token i of the chunk (absolute position start_pos+i) may see keys 0..start_pos+i
            mask = torch.arange(ctx)[None, :] <= (item.start_pos + torch.arange(n))[:, None]
            spans.append(
                PrefillSeqSpan(
                    row, n, g_page.to(self.device), g_off.to(self.device), mask.to(self.device), item.start_pos
                )
            )
            row += n
            last_rows.append(row - 1)
        meta = AttentionMetadata(
            positions=torch.cat(positions).to(self.device),
            write_page=torch.cat(w_page).to(self.device),
            write_off=torch.cat(w_off).to(self.device),
            spans=spans,
            fresh_batches=[self._fresh_batch(g) for g in group_fresh_spans(spans, self.max_padded_length_ratio)],
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = list(last_rows)
        full: dict[int, tuple[int, int]] = {}  # item -> (its first row among `rows`, its length)
        for i in every_row:
            n = len(items[i].token_ids)
            full[i] = (len(rows), n)
            rows.extend(range(last_rows[i] - n + 1, last_rows[i] + 1))
        with self._adapters(items, lambda i: torch.arange(last_rows[i] - len(items[i].token_ids) + 1,
                                                          last_rows[i] + 1)):
            logits = self.model(input_ids, meta, self.pool, torch.tensor(rows, device=self.device))
        return logits[: len(items)], {i: logits[at : at + n] for i, (at, n) in full.items()}

    def _adapters(self, items: Sequence[PrefillItem | DecodeItem], rows_of: Callable[[int], torch.Tensor]):
        """The LoRA rows of one forward (`rows_of(i)`: item i's rows), selected while it runs."""
        if self.adapters is None or not any(item.lora for item in items):
            return contextlib.nullcontext()
        return self.adapters.rows([item.lora for item in items], [rows_of(i) for i in range(len(items))])

    def _fresh_batch(self, group: list[PrefillSeqSpan]) -> FreshBatch:
        longest = max(s.num_tokens for s in group)
        rows = torch.zeros(len(group), longest, dtype=torch.long)
        valid = torch.zeros(len(group), longest, dtype=torch.bool)
        for i, s in enumerate(group):
            rows[i, : s.num_tokens] = torch.arange(s.start, s.start + s.num_tokens)
            valid[i, : s.num_tokens] = True
        mask = None
        if not bool(valid.all()):
            causal = torch.ones(longest, longest, dtype=torch.bool).tril()
            mask = (causal[None] & valid[:, None, :])[:, None].to(self.device)
        return FreshBatch(group, rows.to(self.device), mask)

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One decode step for a batch; returns float32 logits [B, vocab]."""
        b = len(items)
        s_max = max(item.position + 1 for item in items)
        d_page = torch.zeros(b, s_max, dtype=torch.long)
        d_off = torch.zeros(b, s_max, dtype=torch.long)
        mask = torch.zeros(b, s_max, dtype=torch.bool)
        for i, item in enumerate(items):
            ctx = item.position + 1
            self._check_capacity(item.page_table, ctx)
            g_page, g_off = self._slots(item.page_table, 0, ctx)
            d_page[i, :ctx] = g_page
            d_off[i, :ctx] = g_off
            mask[i, :ctx] = True
        meta = AttentionMetadata(
            positions=torch.tensor([it.position for it in items], device=self.device),
            write_page=d_page[torch.arange(b), [it.position for it in items]].to(self.device),
            write_off=d_off[torch.arange(b), [it.position for it in items]].to(self.device),
            decode_page=d_page.to(self.device),
            decode_off=d_off.to(self.device),
            decode_mask=mask.to(self.device),
        )
        input_ids = torch.tensor([it.token_id for it in items], dtype=torch.long, device=self.device)
        with self._adapters(items, lambda i: torch.tensor([i])):
            return self.model(input_ids, meta, self.pool)
