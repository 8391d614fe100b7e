"""min_p, allowed_token_ids and bad_words in the sampler, with vLLM's meanings."""

from __future__ import annotations

import math

import torch

from services.common.sampling_params import SamplingParams
from services.common.wire import params_from_pb, params_to_pb
from services.engine.logits_processors import banned_ids, process
from services.engine.sampler import Sampler

V = 16


def _logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(V) * 3


def _draws(params: SamplingParams, logits: torch.Tensor, history=((1, 2), ()), n: int = 400) -> set[int]:
    sampler = Sampler()
    return {sampler.sample(logits[None], [params], [p], [history])[0][0] for p in range(n)}


def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = _logits()
    probs = torch.softmax(logits, -1)
    min_p = 0.2
    allowed = {i for i in range(V) if probs[i] >= min_p * probs.max()}
    drawn = _draws(SamplingParams(temperature=1.0, seed=3, min_p=min_p), logits)
    assert drawn <= allowed and len(drawn) >= 1
    assert len(_draws(SamplingParams(temperature=1.0, seed=3), logits)) > len(allowed)


def test_min_p_applies_after_temperature():
    logits = _logits()
    hot = 2.0
    probs = torch.softmax(logits / hot, -1)
    allowed = {i for i in range(V) if probs[i] >= 0.3 * probs.max()}
    assert _draws(SamplingParams(temperature=hot, seed=5, min_p=0.3), logits) <= allowed


def test_allowed_token_ids_is_the_only_choice():
    params = SamplingParams(temperature=1.0, seed=1, allowed_token_ids=(3, 7))
    assert _draws(params, _logits()) <= {3, 7}
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=(int(torch.argmin(_logits())),))
    assert _draws(greedy, _logits(), n=1) == {int(torch.argmin(_logits()))}


def test_bad_words_ban_the_last_token_after_the_rest():
    assert banned_ids([(5,)], [], V) == [5]
    assert banned_ids([(4, 5)], [1, 4], V) == [5]
    assert banned_ids([(4, 5)], [4, 1], V) == []
    logits = _logits()
    top = int(torch.argmax(logits))
    out = process(logits, SamplingParams(temperature=0.0, bad_words=((9, top),)), [1], [9])
    assert math.isinf(out[top]) and out[top] < 0
    out = process(logits, SamplingParams(temperature=0.0, bad_words=((9, top),)), [9], [])
    assert out[top] == logits[top]  # the prompt's ids do not count: only generated ones


def test_the_new_fields_survive_the_wire():
    p = SamplingParams(temperature=0.5, seed=9, min_p=0.25, allowed_token_ids=(1, 2, 3), bad_words=((4,), (5, 6)))
    assert params_from_pb(params_to_pb(p)) == p
