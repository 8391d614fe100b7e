"""Logit processing before sampling: allowed_token_ids, bad_words, logit_bias, min_tokens, and the
three penalties, as vLLM defines them.

Order (vLLM v1's Sampler): the masks (allowed_token_ids, then bad_words), the processors that can
change the argmax — min_tokens, then logit_bias — then the penalties (repetition, frequency,
presence); temperature, min_p, top-k and top-p come after, in services/engine/sampler.py.

- allowed_token_ids: every other id gets -inf.
- bad_words (token sequences): a sequence's last id gets -inf when the generated ids end with the
  sequence's other ids (a one-id sequence: always), so no bad word is ever completed.

- repetition_penalty r over prompt + generated tokens: a seen token's logit l becomes l / r if
  l > 0, else l * r.
- frequency_penalty f, presence_penalty p over generated tokens only: l -= f * count + p * (count > 0).
- min_tokens: until that many tokens are generated, the stop tokens (stop_token_ids, which the
  router fills with the model's eos ids too) get -inf.

The state every rule needs (which ids are prompt, which generated, how often each occurs) is
rebuilt from the ids on every call, never carried: prefill, decode, a retracted request's resume
and a migrated request on another pair all see exactly the same history, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.sampling_params import SamplingParams


def split_history(prompt: Sequence[int], output: Sequence[int], params: SamplingParams) -> tuple[list[int], list[int]]:
    """(the request's original prompt ids, every id it generated so far) from a worker's view:
    its prompt (whose last `num_generated` ids an earlier attempt generated) and its own output."""
    cut = len(prompt) - params.num_generated
    return list(prompt[:cut]), list(prompt[cut:]) + list(output)


def banned_ids(bad_words: Sequence[Sequence[int]], generated: Sequence[int], vocab: int) -> list[int]:
    """The ids bad_words forbid as the next token after `generated`."""
    out = []
    for seq in bad_words:
        head, last = seq[:-1], seq[-1]
        if last < vocab and (not head or (len(generated) >= len(head) and list(generated[-len(head):]) == list(head))):
            out.append(last)
    return out


def process(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """A processed copy of one row of float32 logits [V]."""
    vocab, dev = logits.shape[-1], logits.device
    out = logits.clone()
    original, generated = split_history(prompt, output, params)
    if params.allowed_token_ids:
        allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=dev)
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[allowed] = True
        out = out.masked_fill(~keep, float("-inf"))
    banned = banned_ids(params.bad_words, generated, vocab)
    if banned:
        out[torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
    if params.min_tokens and len(generated) < params.min_tokens:
        stops = [t for t in params.stop_token_ids if t < vocab]
        if stops:
            out[torch.tensor(stops, dtype=torch.long, device=dev)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=dev)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=dev))
    if not params.has_penalties:
        return out
    gen = torch.tensor(generated, dtype=torch.long, device=dev)
    counts = torch.bincount(gen, minlength=vocab)[:vocab].to(out.dtype) if generated else torch.zeros_like(out)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if original:
            seen |= torch.bincount(torch.tensor(original, dtype=torch.long, device=dev), minlength=vocab)[:vocab] > 0
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out
