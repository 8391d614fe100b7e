"""Single-process generation: the reference that the disaggregated path must reproduce.

A small continuous-batching loop over the same runner and sampler the workers use: every step
prefills up to `chunk_budget` prompt tokens (splitting long prompts into chunks) and decodes
one token for every running sequence, so prefill and decode batches of mixed lengths are
exercised together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams
from services.engine.grammar import GrammarRegistry
from services.engine.kv_pool import KVPool
from services.engine.lora import LoraAdapters
from services.engine.model import CausalLM
from services.engine.runner import DecodeItem, ModelRunner, PrefillItem
from services.engine.sampler import Sampler


@dataclass
class _Seq:
    idx: int
    prompt: list[int]
    params: SamplingParams
    pages: list[int]
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


def is_stop(token: int, params: SamplingParams, eos_ids: tuple[int, ...]) -> bool:
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)


def generate_full(
    model: CausalLM,
    pool: KVPool,
    prompts: list[list[int]],
    params: list[SamplingParams],
    chunk_budget: int = 512,
    grammars: GrammarRegistry | None = None,
    adapters: LoraAdapters | None = None,
) -> list[Generation]:
    """grammars: needed by requests with structured output (params.grammar); adapters: by requests
    naming a LoRA adapter (params.lora_name)."""
    runner, sampler = ModelRunner(model, pool, adapters), Sampler(grammars)
    eos_ids = model.config.eos_token_ids
    seqs = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if not prompt:
                raise ValueError("empty prompt")
            need = pool.pages_for_tokens(len(prompt) + p.max_tokens)
            seqs.append(_Seq(i, prompt, p, pool.allocator.alloc(need, owner=("local", i))))

        def finish(seq: _Seq, token: int, logprob: float) -> None:
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.done = is_stop(token, seq.params, eos_ids) or len(seq.output) >= seq.params.max_tokens

        while not all(s.done for s in seqs):
            # decode first: sequences already running advance one token
            running = [s for s in seqs if not s.done and s.prefilled == len(s.prompt) and s.output]
            if running:
                pos = [len(s.prompt) + len(s.output) - 1 for s in running]
                logits = runner.decode(
                    [DecodeItem(s.output[-1], p, s.pages, s.params.lora_name) for s, p in zip(running, pos, strict=True)]
                )
                toks, lps = sampler.sample(logits, [s.params for s in running], [p + 1 for p in pos],
                                           [(s.prompt, s.output) for s in running], [("local", s.idx) for s in running])
                for s, t, lp in zip(running, toks, lps, strict=True):
                    finish(s, t, lp)
            # then prefill chunks within the token budget
            budget, chunks = chunk_budget, []
            for s in seqs:
                if budget <= 0:
                    break
                if s.prefilled < len(s.prompt):
                    n = min(budget, len(s.prompt) - s.prefilled)
                    chunks.append((s, n))
                    budget -= n
            if chunks:
                logits = runner.prefill(
                    [PrefillItem(s.prompt[s.prefilled : s.prefilled + n], s.prefilled, s.pages, s.params.lora_name)
                     for s, n in chunks]
                )
                final = []
                for row, (s, n) in enumerate(chunks):
                    s.prefilled += n
                    if s.prefilled == len(s.prompt):
                        final.append((row, s))
                if final:
                    rows = [r for r, _ in final]
                    toks, lps = sampler.sample(
                        logits[rows], [s.params for _, s in final], [len(s.prompt) for _, s in final],
                        [(s.prompt, s.output) for _, s in final], [("local", s.idx) for _, s in final],
                    )
                    for (_, s), t, lp in zip(final, toks, lps, strict=True):
                        finish(s, t, lp)
        return [
            Generation(s.output, s.logprobs, "stop" if is_stop(s.output[-1], s.params, eos_ids) else "length")
            for s in seqs
        ]
    finally:
        for s in seqs:
            pool.allocator.free(s.pages, owner=("local", s.idx))
            if grammars is not None:
                grammars.forget(("local", s.idx))


def generate(
    model: CausalLM,
    pool: KVPool,
    prompts: list[list[int]],
    params: list[SamplingParams],
    chunk_budget: int = 512,
) -> list[list[int]]:
    return [g.token_ids for g in generate_full(model, pool, prompts, params, chunk_budget)]
