"""use_beam_search and length_penalty as the router parses them (services/router/beam_request.py)."""

from __future__ import annotations

import pytest

from services.common.tokenizer import load_tokenizer
from services.router.errors import APIError
from services.router.protocol import ModelInfo, parse_chat, parse_completion

TOK = load_tokenizer("builtin")
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=256, tool_parser="hermes")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def completion(**kw):
    return parse_completion({"model": "m", "prompt": "hello", "max_tokens": 4, "use_beam_search": True, **kw}, INFO)


def refused(parse, **kw) -> str:
    with pytest.raises(APIError) as err:
        parse(**kw)
    assert err.value.status == 400
    return err.value.param


def test_on_with_its_penalty():
    spec = completion(n=4, length_penalty=0.5)
    assert spec.beam_search and spec.length_penalty == 0.5 and spec.n == 4
    off = parse_completion({"model": "m", "prompt": "hello"}, INFO)
    assert not off.beam_search and off.length_penalty == 1.0


@pytest.mark.parametrize("temperature", [None, 0, 0.0, 1, 1.0])
def test_greedy_and_unit_temperature_are_accepted(temperature):
    assert completion(temperature=temperature).beam_search


@pytest.mark.parametrize("field,value", [("temperature", 0.5), ("temperature", True), ("top_p", 0.9), ("top_k", 5),
                                         ("min_p", 0.1), ("presence_penalty", 1.0), ("frequency_penalty", 0.5),
                                         ("repetition_penalty", 1.2), ("logit_bias", {"5": 1}),
                                         ("allowed_token_ids", [1, 2]), ("bad_words", ["x"])])
def test_sampling_fields_it_would_not_honour_are_refused(field, value):
    assert refused(completion, **{field: value}) == field


def test_the_models_own_sampling_defaults_are_not_the_clients_asking():
    info = ModelInfo(name="m", tokenizer=TOK, context_length=256, defaults={"temperature": 0.6, "top_p": 0.9})
    spec = parse_completion({"model": "m", "prompt": "hello", "max_tokens": 4, "use_beam_search": True}, info)
    assert spec.beam_search


def test_width_grammar_and_a_penalty_alone_are_refused():
    assert completion(n=10).n == 10
    assert refused(completion, n=11) == "n"
    assert refused(completion, response_format={"type": "json_object"}) == "response_format"
    assert refused(completion, length_penalty=1000) == "length_penalty"
    assert refused(lambda **kw: parse_completion({"model": "m", "prompt": "x", **kw}, INFO),
                   length_penalty=2.0) == "length_penalty"
    assert refused(lambda **kw: parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "use_beam_search": True, **kw}, INFO),
                   tools=[TOOL], tool_choice="required") == "tools"
