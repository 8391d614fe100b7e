"""Beam search's bookkeeping (services/router/beam_search.py) against a plain reference that runs
every step to max_tokens on a toy model, over many random models and settings: the early stop
never changes the answer."""

from __future__ import annotations

import math
import random

import pytest

from services.router.beam_search import MAX_WIDTH, Beam, BeamSearch, score

VOCAB = 7
EOS = 0


def toy_model(seed: int):
    """A deterministic next-token distribution for every prefix: (token, logprob) most likely first."""
    def top(prefix: tuple[int, ...]) -> list[tuple[int, float]]:
        rng = random.Random(hash((seed, prefix)))
        logits = [rng.gauss(0, 2) for _ in range(VOCAB)]
        z = math.log(sum(math.exp(x) for x in logits))
        return sorted(((t, x - z) for t, x in enumerate(logits)), key=lambda p: -p[1])
    return top


def reference(top, width, max_tokens, stop, min_tokens, length_penalty):
    """vLLM's procedure written out plainly: every step to max_tokens, all stop continuations kept."""
    def value(tokens, cum, stopped):
        return cum / max(len(tokens) - stopped, 1) ** length_penalty

    live = [((), 0.0)]
    done = []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            for t, lp in top(tokens)[: 2 * width]:
                if t in stop:
                    if len(tokens) >= min_tokens:
                        done.append((tokens + (t,), cum + lp, True))
                else:
                    grown.append((tokens + (t,), cum + lp))
        live = sorted(grown, key=lambda b: -value(b[0], b[1], False))[:width]
    everything = done + [(tokens, cum, False) for tokens, cum in live]
    return sorted(everything, key=lambda b: -value(*b))[:width]


def run(top, search: BeamSearch) -> list[Beam]:
    while not search.done:
        search.expand([top(tuple(b.tokens)) for b in search.live])
    return search.result()


@pytest.mark.parametrize("case", range(300))
def test_equals_running_every_step(case):
    rng = random.Random(case)
    top = toy_model(case)
    width, max_tokens = rng.randint(1, 4), rng.randint(1, 7)
    stop = {EOS} if rng.random() < 0.8 else {EOS, 3}
    min_tokens = rng.choice([0, 0, 1, 2])
    length_penalty = rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0])
    got = run(top, BeamSearch(width, max_tokens, stop, min(min_tokens, max_tokens), length_penalty))
    want = reference(top, width, max_tokens, stop, min(min_tokens, max_tokens), length_penalty)
    assert [tuple(b.tokens) for b in got] == [w[0] for w in want]
    for beam, (_, cum, stopped) in zip(got, want, strict=True):
        assert beam.cum == pytest.approx(cum)
        assert beam.finish == ("stop" if stopped else "length")
        assert beam.logprobs and sum(beam.logprobs) == pytest.approx(beam.cum)
        assert len(beam.tops) == len(beam.tokens)


def test_stops_early_once_no_live_beam_can_win():
    # eos is by far the most likely first token: two beams end at once, no continuation beats them
    def top(prefix):
        return [(EOS, -0.01), (1, -5.0), (2, -6.0), (3, -7.0)] if not prefix else [(1, -3.0), (EOS, -4.0), (2, -5.0)]
    search = BeamSearch(1, 50, {EOS}, length_penalty=0.0)
    beams = run(top, search)
    assert search.steps == 1 and beams[0].tokens == [EOS] and beams[0].finish == "stop"


def test_width_one_without_stops_is_greedy():
    top = toy_model(5)
    beams = run(top, BeamSearch(1, 6, set()))
    prefix: tuple[int, ...] = ()
    for _ in range(6):
        prefix += (top(prefix)[0][0],)
    assert tuple(beams[0].tokens) == prefix and beams[0].finish == "length"


def test_no_stop_token_before_min_tokens():
    def top(prefix):
        return [(EOS, -0.1), (1, -2.0), (2, -3.0)]
    beams = run(top, BeamSearch(2, 5, {EOS}, min_tokens=3, length_penalty=0.0))
    assert all(len(b.tokens) >= 4 and b.tokens[-1] == EOS for b in beams)
    assert all(EOS not in b.tokens[:-1] for b in beams)


def test_length_penalty_decides_between_a_short_and_a_long_beam():
    # "a" ends after one token at -2; "b" runs 4 tokens at -1 each (-4 in all)
    def top(prefix):
        if not prefix:
            return [(1, -1.0), (EOS, -2.0)]
        return [(2, -1.0), (EOS, -9.0)] if len(prefix) < 4 else [(EOS, 0.0), (2, -9.0)]
    short_wins = run(top, BeamSearch(1, 8, {EOS}, length_penalty=0.0))[0]
    long_wins = run(top, BeamSearch(1, 8, {EOS}, length_penalty=1.0))[0]
    assert short_wins.tokens == [EOS]
    assert long_wins.tokens == [1, 2, 2, 2, EOS] and score(long_wins, 1.0) == pytest.approx(-1.0)


@pytest.mark.parametrize("width,max_tokens", [(0, 4), (MAX_WIDTH + 1, 4), (2, 0)])
def test_bad_settings_are_refused(width, max_tokens):
    with pytest.raises(ValueError):
        BeamSearch(width, max_tokens, set())


def test_expand_needs_one_result_per_live_beam():
    search = BeamSearch(2, 3, set())
    with pytest.raises(ValueError):
        search.expand([])
