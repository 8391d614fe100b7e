"""Token sampling: logit processing, greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its random number for the token at position p from a generator keyed by
(seed, p), not from a stream that advances with every draw. So prefill (which samples the first
token) and decode (which samples the rest) on different machines reproduce exactly what a
single-process run samples, whatever the batch composition.

Penalties, logit_bias and min_tokens (services/engine/logits_processors.py) need the request's
history: the caller passes (prompt ids, generated ids) per row, and the state is rebuilt from
them on every call. So does a grammar (services/engine/grammar.py): its matcher is a function of
the generated ids, cached per room (`keys`) only to save the work of replaying them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import torch

from services.common.sampling_params import SamplingParams
from services.engine import logits_processors
from services.engine.grammar import GrammarRegistry

History = tuple[Sequence[int], Sequence[int]]  # (the worker's prompt ids, the ids it generated)
TopLogprobs = list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


def _uniform(seed: int | None, position: int) -> float:
    if seed is None:
        return float(torch.rand(()).item())
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return float(torch.rand((), generator=gen).item())


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (probs over the sorted candidate list, their token ids), descending."""
    # extreme controls (a repetition penalty of 1e-60, a huge logit_bias) overflow float32:
    # keep the order and sample among what overflowed rather than fail the request on NaN
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    scaled = logits / params.temperature
    sorted_logits, sorted_ids = torch.sort(scaled, descending=True)
    if params.min_p > 0:
        # vLLM's min_p, after temperature: keep the tokens at least min_p times as likely as the
        # most likely one (probabilities relative to the first: exp(l - l_max))
        keep = torch.exp(sorted_logits - sorted_logits[0]) >= params.min_p
        keep[0] = True
        sorted_logits, sorted_ids = sorted_logits[keep], sorted_ids[keep]
    if params.top_k and params.top_k > 0:
        sorted_logits = sorted_logits[: params.top_k]
        sorted_ids = sorted_ids[: params.top_k]
    probs = torch.softmax(sorted_logits, dim=-1)
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        before = torch.cumsum(probs, dim=-1) - probs
        keep = before < params.top_p
        keep[0] = True
        probs = probs[keep]
        sorted_ids = sorted_ids[keep]
        probs = probs / probs.sum()
    return probs, sorted_ids


class Sampler:
    def __init__(self, grammars: GrammarRegistry | None = None):
        self.grammars = grammars  # None: this worker cannot serve structured output

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: Sequence[History] | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[list[int], list[float]]:
        tokens, logprobs, _ = self.sample_full(logits, params, positions, histories, keys)
        return tokens, logprobs

    def sample_full(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: Sequence[History] | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """logits [B, V] float32; positions[i] = the position the sampled token will occupy;
        histories[i] = (prompt ids, generated ids) of row i, needed by rows whose params process
        the logits (penalties, logit_bias, min_tokens, grammar); keys[i] = the row's room, under
        which its grammar matcher is cached (None: rebuilt from the ids on every call).

        Returns the chosen token ids, their logprobs under the raw (unprocessed, untempered)
        distribution, as vLLM reports them by default, and per row the top_logprobs alternatives
        (None for rows that asked for none).
        """
        logits = logits.float()
        logprobs_all = torch.log_softmax(logits, dim=-1)
        greedy_ids = torch.argmax(logits, dim=-1).tolist()
        tokens: list[int] = []
        allowed = self._grammar_masks(params, histories, keys)
        for i, p in enumerate(params):
            row = logits[i]
            if p.processes_logits:
                if histories is None:
                    raise ValueError("this request's sampling needs its token history")
                if p.has_penalties or p.logit_bias or p.min_tokens or p.restricts_tokens:
                    row = logits_processors.process(row, p, *histories[i])
                if p.grammar is not None:
                    row = _constrain(row, logits[i], allowed[i])
                if p.greedy:
                    tokens.append(int(torch.argmax(torch.nan_to_num(row, nan=float("-inf"))).item()))
                    continue
            elif p.greedy:
                tokens.append(greedy_ids[i])
                continue
            probs, ids = _filtered_probs(row, p)
            u = _uniform(p.seed, positions[i])
            cdf = torch.cumsum(probs.double(), dim=-1)
            idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)).item())
            tokens.append(int(ids[min(idx, ids.numel() - 1)].item()))
        chosen = torch.tensor(tokens, device=logits.device)
        logprobs = logprobs_all[torch.arange(len(tokens), device=logits.device), chosen].tolist()
        tops: list[TopLogprobs | None] = [None] * len(params)
        k_max = max((p.top_logprobs for p in params), default=0)
        if k_max:
            values, ids = torch.topk(logprobs_all, min(k_max, logits.shape[-1]), dim=-1)
            values, ids = values.tolist(), ids.tolist()
            for i, p in enumerate(params):
                if p.top_logprobs:
                    tops[i] = list(zip(ids[i][: p.top_logprobs], values[i][: p.top_logprobs], strict=True))
        return tokens, logprobs, tops

    def _grammar_masks(self, params, histories, keys) -> dict[int, torch.Tensor]:
        """Row index -> bool mask of the tokens its grammar allows, for the rows with a grammar."""
        rows = [i for i, p in enumerate(params) if p.grammar is not None]
        if not rows:
            return {}
        if self.grammars is None:
            raise ValueError("this worker serves no structured output (no grammar registry)")
        if histories is None:
            raise ValueError("this request's sampling needs its token history")
        specs = []
        for i in rows:
            _, generated = logits_processors.split_history(*histories[i], params[i])
            specs.append((keys[i] if keys else None, params[i].grammar, generated))
        return dict(zip(rows, self.grammars.allowed_masks(specs), strict=True))


def _constrain(row: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Mask out what the grammar forbids. The grammar wins over the other controls: when they
    leave nothing it allows (min_tokens holding back the end of a complete JSON value), sample
    among the grammar's choices of the raw logits."""
    allowed = allowed.to(row.device)
    masked = row.masked_fill(~allowed, float("-inf"))
    if not torch.isfinite(masked).any():
        masked = raw.masked_fill(~allowed, float("-inf"))
    return masked
