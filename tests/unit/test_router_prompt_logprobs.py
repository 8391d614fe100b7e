"""The router's rendering of prompt logprobs: OpenAI's echo + logprobs shape on completions (the
prompt's tokens lead, the first null), vLLM's prompt_logprobs (per choice on completions, beside
the choices on chat), max_tokens 0 with echo, streamed events, and a large body built in slices."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.prompt_logprobs import PromptLogprobs
from services.router.orchestrator import Chunk
from services.router.output import TokenStrings
from services.router.protocol import GenerateSpec
from services.router.render import BODY_SLICE, ResponseState

TOK = BuiltinTokenizer()
PROMPT = [ord(c) for c in "abcd"]  # byte tokens: a token's text is its character


def spec(**kw) -> GenerateSpec:
    base = dict(kind="completion", model="m", prompt_ids=PROMPT, max_tokens=2, echo=True,
                echo_text=TOK.decode(PROMPT, skip_special_tokens=False))
    return GenerateSpec(**{**base, **kw})


def prompt_lp(ids=PROMPT, k=2) -> PromptLogprobs:
    """Position i + 1's own token at -(i + 1), rank 2; alternatives: 'z' (-0.5), then the own token."""
    lp = PromptLogprobs(k)
    for i, token in enumerate(ids[1:]):
        lp.logprobs.append(-(i + 1.0))
        lp.ranks.append(2)
        lp.top_ids += [ord("z"), token][:k]
        lp.top_logprobs += [-0.5, -(i + 1.0)][:k]
    return lp


def state_for(s: GenerateSpec) -> ResponseState:
    return ResponseState(s, TOK, TokenStrings(TOK), "r")


def test_echo_with_logprobs_is_openais_legacy_shape():
    state = state_for(spec(logprobs=1))
    text, entries = state.feed(Chunk([ord("e")], [-0.25], "", [[(ord("e"), -0.25)]], prompt=prompt_lp()))
    assert text == "abcde" and len(entries) == 5
    state.feed(Chunk([ord("f")], [-0.75], "length", [[(ord("q"), -0.1)]]))
    choice = state.body()["choices"][0]
    assert choice["text"] == "abcdef"
    lp = choice["logprobs"]
    assert lp["tokens"] == list("abcdef")
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -3.0, -0.25, -0.75]
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    # k = 1: the most likely alternative, and the token itself where it is not that one
    assert lp["top_logprobs"] == [None, {"z": -0.5, "b": -1.0}, {"z": -0.5, "c": -2.0}, {"z": -0.5, "d": -3.0},
                                  {"e": -0.25}, {"q": -0.1, "f": -0.75}]
    assert "prompt_logprobs" not in choice  # not asked for by that name


def test_echo_logprobs_zero_has_null_top_logprobs():
    state = state_for(spec(logprobs=0))
    state.feed(Chunk([ord("e")], [-0.25], "length", prompt=prompt_lp(k=0)))
    lp = state.body()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] is None and lp["token_logprobs"][:2] == [None, -1.0]


def test_max_tokens_zero_with_echo_is_the_prompt_alone():
    state = state_for(spec(logprobs=1, echo_only=True, max_tokens=1))
    text, entries = state.feed(Chunk([ord("e")], [-0.25], "length", [[(ord("e"), -0.25)]], prompt=prompt_lp()))
    assert text == "abcd" and len(entries) == 4 and state.finish_reason == "length"
    body = state.body()
    assert body["choices"][0]["logprobs"]["tokens"] == list("abcd")
    assert body["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_per_choice_on_completions():
    state = state_for(spec(echo=False, echo_text="", prompt_logprobs=2))
    state.feed(Chunk([ord("e")], [-0.25], "length", prompt=prompt_lp()))
    plp = state.body()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    assert plp[1] == {str(ord("b")): {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
                      str(ord("z")): {"logprob": -0.5, "rank": 1, "decoded_token": "z"}}


def test_vllm_prompt_logprobs_beside_the_choices_on_chat():
    state = state_for(spec(kind="chat", echo=False, echo_text="", prompt_logprobs=0))
    state.feed(Chunk([ord("e")], [-0.25], "length", prompt=prompt_lp(k=0)))
    body = state.body()
    assert "prompt_logprobs" not in body["choices"][0]
    assert body["prompt_logprobs"] == [None] + [{str(t): {"logprob": -(i + 1.0), "rank": 2,
                                                          "decoded_token": chr(t)}}
                                                for i, t in enumerate(PROMPT[1:])]


def test_streamed_events_lead_with_the_prompt():
    state = state_for(spec(logprobs=1, stream=True))
    chunk = Chunk([ord("e"), ord("f")], [-0.25, -0.75], "length", [[(ord("e"), -0.25)], [(ord("f"), -0.75)]],
                  prompt=prompt_lp())
    events = [state.delta_chunk(t, e, f) for t, e, f in state.feed_each(chunk)]
    first = events[0]["choices"][0]
    assert first["text"] == "abcde" and first["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -3.0, -0.25]
    assert events[1]["choices"][0]["logprobs"]["text_offset"] == [5]


def test_a_long_echo_body_built_in_slices_equals_the_plain_one():
    ids = [ord("a") + i % 26 for i in range(BODY_SLICE * 2 + 7)]
    s = spec(prompt_ids=ids, echo_text=TOK.decode(ids, skip_special_tokens=False), logprobs=1)
    state = state_for(s)
    state.feed(Chunk([ord("e")], [-0.25], "length", [[(ord("e"), -0.25)]], prompt=prompt_lp(ids)))
    sliced = json.loads(asyncio.run(state.body_json()))
    assert sliced["choices"][0]["logprobs"] == state.body()["choices"][0]["logprobs"]
    assert sliced["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_missing_prompt_logprobs_is_an_error_not_a_silent_gap():
    state = state_for(spec(logprobs=1))
    with pytest.raises(ValueError):
        state.feed(Chunk([ord("e")], [-0.25], "length", [[(ord("e"), -0.25)]]))
