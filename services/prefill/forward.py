"""One prefill batch on the engine thread: chunk forwards, prompt logprobs, first tokens.

Kept apart from the scheduler (services/prefill/worker.py), which owns the jobs on the asyncio
loop and only hands plain lists in here.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.sampling_params import SamplingParams
from services.engine.prompt_logprobs import PromptLogprobs, reduce_chunk
from services.engine.runner import PrefillItem
from services.engine.sampler import History, TopLogprobs
from services.engine.worker_engine import WorkerEngine


@dataclass
class Sample:
    """Who samples a first token after the forward: the jobs whose final chunk is in the batch, in order."""

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
    engine: WorkerEngine, items: list[PrefillItem], finals: list[int], sample: Sample,
    prompt_rows: list[PromptRows] = (),
) -> tuple[list[int], list[float], list[TopLogprobs | None], dict[int, PromptLogprobs]]:
    """Runs on the engine thread. Returns the sampled (tokens, logprobs, top_logprobs) of the
    `finals` (indices among items), and the prompt logprobs of `prompt_rows`' items (by item
    index): each chunk's rows are reduced at once, so at most one chunk's [rows, vocab] logits exist."""
    logits, full = engine.runner.prefill_rows(items, [p.item for p in prompt_rows])
    prompt = {p.item: reduce_chunk(full.pop(p.item), p.targets, p.k) for p in prompt_rows}
    del full
    if not sample.params:
        return [], [], [], prompt
    # one token per request here: a grammar's matcher is built from the ids, not cached
    tokens, logprobs, tops = engine.sampler.sample_full(logits[finals], sample.params, sample.positions,
                                                        sample.histories)
    return tokens, logprobs, tops, prompt
