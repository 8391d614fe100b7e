"""Colocated baseline: decode computes a prompt itself, with no prefill worker and no KV transfer.

A Decode request with `colocated` set goes PREALLOC → PREFILLING (admission gives it the pages
for its prompt + 1 token) → RUNNING. The scheduler alternates: one local prefill forward —
chunks of the PREFILLING jobs in order (priority, then arrival), at most `chunk_budget` tokens in all
(--chunked-prefill-size, as prefill's scheduler does) — then one decode step of the running
batch. A long prompt therefore spreads over several forwards with decode steps between them,
the way a colocated engine with chunked prefill (SGLang, vLLM) interleaves them. A job whose
last chunk ran samples its first token here at position len(prompt), exactly as prefill
would (sampling is keyed by (seed, position)), and joins the batch through `worker.emit`.

Same runner, sampler, pages and finish path as the disaggregated path: only the source of the
prompt's KV and first token differs. A job asking for prompt logprobs reduces each of its chunks' rows in the same forward
(services/engine/prompt_logprobs.py). The pure part (`pick_chunks`) has no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.decode.jobs import Job, Phase
from services.engine.prompt_logprobs import chunk_targets, reduce_chunk
from services.engine.runner import PrefillItem


def pick_chunks(jobs: Sequence[Job], budget: int) -> list[tuple[Job, int]]:
    """(job, tokens of its next chunk) for the PREFILLING jobs, oldest first, within `budget`."""
    batch: list[tuple[Job, int]] = []
    for job in sorted((j for j in jobs if j.phase is Phase.PREFILLING), key=lambda j: j.order):
        if budget <= 0:
            break
        n = min(budget, len(job.token_ids) - job.prefilled)
        batch.append((job, n))
        budget -= n
    return batch


async def run_chunks(scheduler, batch: list[tuple[Job, int]]) -> None:
    """One local prefill forward for `batch`; finished prompts emit their first token."""
    worker, engine = scheduler.worker, scheduler.engine
    items = [PrefillItem(j.token_ids[j.prefilled : j.prefilled + n], j.prefilled, list(j.pages), j.params.lora_name)
             for j, n in batch]
    finals = [i for i, (j, n) in enumerate(batch) if j.prefilled + n == len(j.token_ids)]
    params = [batch[i][0].params for i in finals]
    positions = [len(batch[i][0].token_ids) for i in finals]
    histories = [(batch[i][0].token_ids, ()) for i in finals]  # for penalties / logit_bias / min_tokens / grammar
    rooms = [batch[i][0].room for i in finals]
    # prompt logprobs: each chunk's rows reduced at once, so only one chunk's logits exist
    prompt_rows = [(i, chunk_targets(j.token_ids, j.prefilled, n), j.params.prompt_logprobs)
                   for i, (j, n) in enumerate(batch) if j.params.prompt_logprobs is not None]

    def forward():
        logits, full = engine.runner.prefill_rows(items, [i for i, _, _ in prompt_rows])
        prompt = {i: reduce_chunk(full.pop(i), targets, k) for i, targets, k in prompt_rows}
        sampled = (engine.sampler.sample_full(logits[finals], params, positions, histories, rooms) if finals
                   else ([], [], []))
        return sampled, prompt

    result = await scheduler._forward([j for j, _ in batch], forward)
    prompt = {} if isinstance(result, Exception) else result[1]
    sampled = {} if isinstance(result, Exception) else dict(zip(finals, zip(*result[0], strict=True), strict=True))
    overruns = scheduler.grammar_overruns()
    for i, (job, n) in enumerate(batch):
        if job.finished:  # aborted or evicted mid-forward: its release waited for the forward
            worker.release(job)
        elif job.room in overruns:
            scheduler.fail_overrun(job, overruns[job.room])
        elif isinstance(result, Exception):
            worker.fail(job, f"local prefill failed: {type(result).__name__}: {result}", "INTERNAL")
        else:
            job.prefilled += n
            if i in prompt:
                if job.prompt_lp is None:
                    job.prompt_lp = prompt[i]
                else:
                    job.prompt_lp.extend(prompt[i])
            if i in sampled:
                job.phase = Phase.RUNNING
                worker.emit(job, *sampled[i])
