import math

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.sampler import Sampler


@pytest.fixture
def logits():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 50, generator=gen) * 3


def test_greedy_is_argmax_and_logprob_is_log_softmax(logits):
    toks, lps = Sampler().sample(logits, [SamplingParams(temperature=0)] * 4, [10] * 4)
    assert toks == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(toks)]
    assert lps == pytest.approx(ref.tolist(), abs=1e-6)


def test_top_k_one_is_greedy(logits):
    toks, _ = Sampler().sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=3)] * 4, [0] * 4)
    assert toks == logits.argmax(-1).tolist()


def test_seeded_draw_depends_on_seed_and_position_only(logits):
    s = Sampler()
    row = logits[1:2]
    p = SamplingParams(temperature=1.0, seed=42)
    a = [s.sample(row, [p], [pos])[0][0] for pos in range(30)]
    b = [s.sample(row, [p], [pos])[0][0] for pos in range(30)]
    assert a == b
    # same row placed at another batch index with other requests around it: same result
    batch = torch.cat([logits[0:1], row, logits[2:]])
    other = SamplingParams(temperature=1.0, seed=7)
    c = [s.sample(batch, [other, p, other, other], [pos] * 4)[0][1] for pos in range(30)]
    assert a == c
    d = [s.sample(row, [SamplingParams(temperature=1.0, seed=43)], [pos])[0][0] for pos in range(30)]
    assert a != d


def test_top_k_and_top_p_restrict_support(logits):
    s = Sampler()
    row = logits[0]
    top3 = set(torch.topk(row, 3).indices.tolist())
    got = {s.sample(row[None], [SamplingParams(temperature=2.0, top_k=3, seed=9)], [i])[0][0] for i in range(200)}
    assert got <= top3 and len(got) > 1
    probs = torch.softmax(row, -1)
    sorted_p, sorted_i = torch.sort(probs, descending=True)
    n_keep = int((torch.cumsum(sorted_p, -1) - sorted_p < 0.5).sum())
    nucleus = set(sorted_i[:n_keep].tolist())
    got = {s.sample(row[None], [SamplingParams(temperature=1.0, top_p=0.5, seed=9)], [i])[0][0] for i in range(200)}
    assert got <= nucleus


def test_sampling_follows_the_distribution():
    s = Sampler()
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [s.sample(logits, [SamplingParams(temperature=1.0, seed=5)], [i])[0][0] for i in range(3000)]
    for tok, p in enumerate([0.7, 0.2, 0.1]):
        freq = draws.count(tok) / len(draws)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(draws))


def test_invalid_params_rejected():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_controls_that_overflow_float32_still_sample_a_token():
    # found by schemathesis: repetition_penalty 2.7e-67 turned positive logits into inf, the
    # softmax into NaN, the top-p filter into an empty list, and the forward into an IndexError
    logits = torch.randn(2, 64) * 5
    params = [SamplingParams(temperature=1.0, top_p=0.57, top_k=61084, repetition_penalty=2.7e-67, seed=3),
              SamplingParams(temperature=0.0, repetition_penalty=1e-60, seed=3)]
    history = ([1, 2, 3, 40], [4])
    tokens, logprobs = Sampler().sample(logits, params, [5, 5], [history, history])
    assert all(0 <= t < 64 for t in tokens) and len(logprobs) == 2
