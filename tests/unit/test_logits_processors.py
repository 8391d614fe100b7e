"""Penalties, logit_bias and min_tokens against a plain-Python reference of vLLM's definitions."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.logits_processors import process, split_history
from services.engine.sampler import Sampler

V = 40


def reference(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order, one token at a time: min_tokens, logit_bias, repetition, frequency, presence."""
    cut = len(prompt) - p.num_generated
    original, generated = prompt[:cut], prompt[cut:] + output
    out = list(logits)
    if len(generated) < p.min_tokens:
        for t in p.stop_token_ids:
            out[t] = float("-inf")
    for t, b in p.logit_bias:
        out[t] += b
    for t in range(V):
        count = generated.count(t)
        if t in original or count:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * count
        out[t] -= p.presence_penalty * (1 if count else 0)
    return out


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias=tuple(sorted({rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(4))}.items())),
        min_tokens=rng.randrange(4),
        stop_token_ids=tuple(rng.sample(range(V), 2)),
        num_generated=rng.randrange(3),
    )


@pytest.mark.parametrize("case", range(200))
def test_process_matches_the_reference(case):
    rng = random.Random(case)
    p = random_params(rng)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(p.num_generated + 1, 12))]
    output = [rng.randrange(V) for _ in range(rng.randrange(5))]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(case)) * 4
    got = process(logits, p, prompt, output).tolist()
    want = reference(logits.tolist(), p, prompt, output)
    assert got == pytest.approx(want, abs=1e-4)


def test_split_history_counts_migrated_ids_as_generated():
    p = SamplingParams(num_generated=2)
    assert split_history([1, 2, 3, 4, 5], [6], p) == ([1, 2, 3], [4, 5, 6])
    assert split_history([1, 2, 3], [], SamplingParams()) == ([1, 2, 3], [])


def test_sampler_applies_processing_greedy_and_reports_raw_logprobs():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    top = int(logits[0].argmax())
    p = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    toks, lps = Sampler().sample(logits[:1], [p], [5], [([1, 2], [])])
    assert toks[0] != top
    assert toks[0] == int(logits[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[toks[0]]), abs=1e-6)


def test_min_tokens_holds_back_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0  # the stop token is by far the most likely
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    s = Sampler()
    assert s.sample(logits, [p], [4], [([1, 2], [3, 4])])[0][0] != 7
    assert s.sample(logits, [p], [5], [([1, 2], [3, 4, 5])])[0][0] == 7
    # a migrated request: two of its "prompt" ids were generated before
    moved = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,), num_generated=2)
    assert s.sample(logits, [moved], [5], [([1, 2, 3, 4], [5])])[0][0] == 7


def test_seeded_sampling_with_penalties_is_reproducible_and_history_dependent():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=3, presence_penalty=2.0, frequency_penalty=1.0)
    s = Sampler()
    a = [s.sample(logits, [p], [i], [([1], [int(logits.argmax())] * 3)])[0][0] for i in range(50)]
    b = [s.sample(logits, [p], [i], [([1], [int(logits.argmax())] * 3)])[0][0] for i in range(50)]
    assert a == b
    plain = SamplingParams(temperature=1.0, seed=3)
    c = [s.sample(logits, [plain], [i])[0][0] for i in range(50)]
    assert a != c


def test_processing_without_history_is_refused():
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(torch.zeros(1, V), [SamplingParams(presence_penalty=1.0)], [0])


def test_invalid_values_are_refused():
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
               {"logit_bias": ((1, 101.0),)}, {"min_tokens": -1}, {"num_generated": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
