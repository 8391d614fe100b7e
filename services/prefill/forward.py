"""One prefill batch on the engine thread: chunk forwards, KV copies for followers, first tokens.

Kept apart from the scheduler (services/prefill/worker.py), which owns the jobs on the asyncio
loop and only hands plain lists in here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.sampling_params import SamplingParams
from services.engine.prompt_logprobs import PromptLogprobs, reduce_chunk
from services.engine.runner import PrefillItem
from services.engine.sampler import History, TopLogprobs
from services.engine.worker_engine import WorkerEngine


@dataclass
class Copy:
    """A follower's share of its leader's prompt (services/prefill/sharing.py)."""

    pages: list[int]  # the follower's own pages, as many as the leader's
    src_pages: list[int]  # the leader's
    src_final: int | None  # the leader's final chunk is in this batch: its index among `finals`
    src_logits: torch.Tensor | None  # else the leader's kept last-position logits


@dataclass
class Sample:
    """Who samples a first token after the forward: the final chunks, then the copies, in order."""

    params: list[SamplingParams]
    positions: list[int]
    histories: list[History]


@dataclass
class PromptRows:
    """An item whose chunk reports prompt logprobs: the prompt tokens its rows predict, and k."""

    item: int
    targets: list[int]
    k: int


def run_batch(
    engine: WorkerEngine, items: list[PrefillItem], finals: list[int], copies: list[Copy], sample: Sample,
    keep: list[int], prompt_rows: list[PromptRows] = (),
) -> tuple[list[int], list[float], list[TopLogprobs | None], dict[int, torch.Tensor], dict[int, PromptLogprobs]]:
    """Runs on the engine thread. Returns the sampled (tokens, logprobs, top_logprobs) — the
    finals' then the copies' — the logits rows of `keep` (indices among `finals`: leaders whose followers
    may arrive later), and the prompt logprobs of `prompt_rows`' items (by item index): each
    chunk's rows are reduced at once, so at most one chunk's [rows, vocab] logits exist."""
    rows = []
    final_logits = None
    prompt: dict[int, PromptLogprobs] = {}
    if items:
        logits, full = engine.runner.prefill_rows(items, [p.item for p in prompt_rows])
        for p in prompt_rows:
            prompt[p.item] = reduce_chunk(full.pop(p.item), p.targets, p.k)
        del full
        final_logits = logits[finals]
        rows.append(final_logits)
    if copies:
        # copy before anyone can reuse the leader's pages: it is pinned until this returns
        engine.pool.copy_pages([p for c in copies for p in c.src_pages], [p for c in copies for p in c.pages])
        picked = [final_logits[c.src_final] if c.src_final is not None else c.src_logits for c in copies]
        rows.append(torch.stack(picked))
    kept = {i: final_logits[i].clone() for i in keep} if final_logits is not None else {}
    if not sample.params:
        return [], [], [], kept, prompt
    # one token per request here: a grammar's matcher is built from the ids, not cached
    tokens, logprobs, tops = engine.sampler.sample_full(torch.cat(rows), sample.params, sample.positions,
                                                        sample.histories)
    return tokens, logprobs, tops, kept, prompt
