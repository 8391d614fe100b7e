"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`), one chunk at a time.

The logits at prompt position p predict the token at p + 1, so a chunk of positions
[start, start + n) gives the logprobs of prompt tokens start + 1 .. start + n (those that exist:
the final chunk's last row predicts the first *generated* token, which the sampler reports).
Position 0 has no context and no logprob (OpenAI's null first entry).

Only one chunk's [n, vocab] logits exist at a time (n <= --chunked-prefill-size): each chunk's
rows are reduced here, on the engine thread, to per position the prompt token's logprob, its
rank and the k most likely alternatives, and the logits are dropped before the next chunk runs.

Values are the raw distribution (log-softmax of the model's logits: no temperature, penalties or
masks), as vLLM reports prompt logprobs.

The prefix cache never answers for a job that asks for them: its cached tokens would have no
logits. Such a job computes its whole prompt (as vLLM skips the cache for such a request), and its
computed pages still join the cache for later requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.prompt_logprobs import PromptLogprobs

__all__ = ["PromptLogprobs", "chunk_targets", "reduce_chunk"]


def chunk_targets(prompt: Sequence[int], start: int, n: int) -> list[int]:
    """The prompt tokens the chunk [start, start + n) predicts (fewer than n on the final chunk)."""
    return list(prompt[start + 1 : start + n + 1])


@torch.inference_mode()
def reduce_chunk(logits: torch.Tensor, targets: Sequence[int], k: int) -> PromptLogprobs:
    """logits [n, vocab] float32 of one chunk's rows; targets: the next prompt token of the first
    len(targets) rows (the rest, at most the final row, predict nothing in the prompt)."""
    m = len(targets)
    out = PromptLogprobs(min(k, logits.shape[-1]))
    if m == 0:
        return out
    lp = torch.log_softmax(logits[:m].float(), dim=-1)  # [m, vocab]
    tgt = torch.tensor(targets, dtype=torch.long, device=lp.device)
    own = lp.gather(1, tgt[:, None])  # [m, 1]
    ranks = (lp > own).sum(dim=1) + 1
    out.logprobs = own[:, 0].tolist()
    out.ranks = ranks.tolist()
    if k > 0:
        top = torch.topk(lp, out.k, dim=-1)
        out.top_ids = top.indices.flatten().tolist()
        out.top_logprobs = top.values.flatten().tolist()
    return out
