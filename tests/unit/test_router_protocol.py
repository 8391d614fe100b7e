"""Router request validation: every OpenAI field, every bad input → the right 400/404 and param."""

from __future__ import annotations

import pytest

from services.common.builtin_tokenizer import BUILTIN_BOS_ID, BUILTIN_EOS_ID, BuiltinTokenizer
from services.router.errors import APIError
from services.router.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ModelInfo,
    parse_chat,
    parse_completion,
)

TOK = BuiltinTokenizer()
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=64, aliases=frozenset({"builtin"}))
MSGS = [{"role": "user", "content": "hi"}]


def completion(**kw):
    return parse_completion({"model": "m", "prompt": "hello", **kw}, INFO)


def chat(**kw):
    body = {"model": "m", "messages": MSGS, **kw}
    return parse_chat(body, INFO)


def rejects(fn, status=400, param=None, **kw):
    with pytest.raises(APIError) as info:
        fn(**kw)
    err = info.value
    assert err.status == status, err
    if param is not None:
        assert err.param == param, err
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return err


def test_completion_defaults():
    spec = completion()
    assert spec.kind == "completion" and spec.model == "m"
    assert spec.prompt_ids == [BUILTIN_BOS_ID, *b"hello"]
    assert spec.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert spec.temperature == 1.0 and spec.top_p == 1.0 and spec.top_k == 0
    assert 0 <= spec.seed < 2**63  # a random seed is always sent
    assert not spec.stream and not spec.include_usage and spec.logprobs is None and spec.stop == []


def test_random_seeds_differ_and_given_seed_is_kept():
    assert len({completion().seed for _ in range(8)}) > 1
    assert completion(seed=1234).seed == 1234
    assert completion(seed=-1).seed == 2**64 - 1  # negative seeds map into uint64


def test_prompt_forms():
    assert completion(prompt=[1, 2, 3]).prompt_ids == [1, 2, 3]
    assert completion(prompt=["ab"]).prompt_ids == [BUILTIN_BOS_ID, 97, 98]
    assert completion(prompt=[[5, 6]]).prompt_ids == [5, 6]


def test_alias_model_name_is_accepted_and_normalized():
    assert completion(model="builtin").model == "m"


def test_chat_prompt_and_default_max_tokens_fill_the_context():
    spec = chat()
    assert spec.prompt_ids == TOK.encode_chat(MSGS)
    assert spec.max_tokens == INFO.context_length - len(spec.prompt_ids)
    assert chat(max_completion_tokens=5, max_tokens=7).max_tokens == 5
    assert chat(max_tokens=7).max_tokens == 7


def test_chat_content_parts_and_developer_role():
    spec = chat(messages=[{"role": "developer", "content": "be nice"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert spec.prompt_ids == TOK.encode_chat([{"role": "system", "content": "be nice"},
                                               {"role": "user", "content": "a\nb"}])


def test_chat_tool_turns_are_rendered_by_the_template():
    turns = [{"role": "user", "content": "w?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "content": "x", "tool_call_id": "c"}]
    text = bytes(t for t in chat(messages=turns).prompt_ids if t < 256)
    assert b'{"name": "f", "parameters": {}}' in text and b"Tool result: x" in text


def test_sampling_fields():
    spec = completion(temperature=0, top_p=0.5, top_k=7, max_tokens=3, stop="x", stop_token_ids=[BUILTIN_EOS_ID],
                      ignore_eos=True, stream=True, stream_options={"include_usage": True}, logprobs=2, user="u",
                      some_unknown_field={"ignored": True})
    assert (spec.temperature, spec.top_p, spec.top_k, spec.max_tokens) == (0.0, 0.5, 7, 3)
    assert spec.stop == ["x"] and spec.stop_token_ids == [BUILTIN_EOS_ID] and spec.ignore_eos
    assert spec.stream and spec.include_usage and spec.logprobs == 2
    assert completion(top_p=0).top_k == 1  # top_p 0 = only the most likely token
    assert completion(top_k=-1).top_k == 0
    # found by schemathesis: a top_k beyond int32 used to overflow the wire format (500)
    assert completion(top_k=2569974698847144).top_k == 0
    assert completion(stop=["a", "", "a", "b"]).stop == ["a", "b"]
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).logprobs == 3


def test_echo():
    spec = completion(echo=True)
    assert spec.echo and spec.echo_text == "hello"


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"model": 3}, "model"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [10_000]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": 60}, "max_tokens"),  # prompt (6) + 60 > context 64
        ({"prompt": "x" * 80}, "prompt"),  # longer than the context
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 3]}, "stop[1]"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": "1"}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 11}, "repetition_penalty"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"99999": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": "5"}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
        ({"suffix": "abc"}, "suffix"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "whole vocabulary" is above the max
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # vLLM refuses them on a stream
        ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"max_tokens": 0, "echo": False}, "max_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_completion_bad_inputs(kw, param):
    rejects(completion, param=param, **kw)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 100}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 100}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_chat_bad_inputs(kw, param):
    rejects(chat, param=param, **kw)


def test_a_missing_model_is_the_served_one():
    # as vLLM and SGLang: a body without `model` (or with null or "") asks for the model served
    for body in ({"prompt": "hello"}, {"prompt": "hello", "model": None}, {"prompt": "hello", "model": ""}):
        assert parse_completion(body, INFO).model == "m"
    assert parse_chat({"messages": MSGS}, INFO).model == "m"
    assert parse_completion({"prompt": "x", "model": "builtin"}, INFO).model == "m"  # an alias answers as the name


def test_unknown_model_is_404():
    err = rejects(completion, status=404, param="model", model="gpt-9")
    assert err.code == "model_not_found"


def test_body_must_be_an_object():
    with pytest.raises(APIError) as e:
        parse_completion([1, 2], INFO)
    assert e.value.status == 400
    with pytest.raises(APIError):
        parse_chat("x", INFO)


def test_context_error_says_why():
    err = rejects(completion, param="max_tokens", max_tokens=60)
    assert "maximum context length is 64" in err.message and err.code == "context_length_exceeded"


def test_sampling_controls_are_parsed():
    spec = parse_completion(
        {"model": "m", "prompt": "hi", "n": 3, "best_of": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
         "repetition_penalty": 1.3, "logit_bias": {"65": 10, "66": -100.0}, "min_tokens": 4, "seed": 7},
        INFO,
    )
    assert (spec.n, spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty) == (3, 0.5, -1.0, 1.3)
    assert spec.logit_bias == ((65, 10.0), (66, -100.0))
    assert spec.min_tokens == 4
    assert [spec.choice_seed(i) for i in range(3)] == [7, 8, 9]


def test_echo_with_logprobs_asks_the_workers_for_prompt_logprobs():
    spec = completion(echo=True, logprobs=1, max_tokens=1)
    assert spec.echo_logprobs and spec.worker_prompt_logprobs == 1 and not spec.echo_only
    # prompt_logprobs and echo logprobs together: the workers compute the larger k once
    assert completion(echo=True, logprobs=1, prompt_logprobs=3).worker_prompt_logprobs == 3
    assert completion(prompt_logprobs=0).worker_prompt_logprobs == 0
    assert completion(logprobs=2).worker_prompt_logprobs is None  # no echo: generated tokens only
    assert completion(echo=True).worker_prompt_logprobs is None


def test_max_tokens_zero_with_echo_is_the_prompt_alone():
    spec = completion(echo=True, logprobs=1, max_tokens=0)
    assert spec.echo_only and spec.max_tokens == 1  # the workers sample one token, left out of the reply
    batch = completion(prompt=["ab", "cd"], echo=True, logprobs=0, max_tokens=0)
    assert all(p.echo_only and p.worker_prompt_logprobs == 0 for p in batch.prompts)


def test_chat_prompt_logprobs():
    assert chat(prompt_logprobs=2).prompt_logprobs == 2
    rejects(chat, param="prompt_logprobs", prompt_logprobs=21)
    rejects(chat, param="prompt_logprobs", prompt_logprobs=1, stream=True)


def test_prompt_logprobs_reply_must_fit_one_message():
    from services.router.limits import check_prompt_logprobs_size

    check_prompt_logprobs_size(100_000, 20, "prompt")  # ~31 MB
    with pytest.raises(APIError) as err:
        check_prompt_logprobs_size(400_000, 20, "prompt")
    assert err.value.status == 400 and err.value.code == "request_too_large"


def test_cache_salt_is_a_non_empty_bounded_string():
    assert completion(cache_salt="tenant-1").cache_salt == "tenant-1" == chat(cache_salt="tenant-1").cache_salt
    assert completion().cache_salt == "" == completion(cache_salt=None).cache_salt
    for bad in ("", "x" * 1025, 5, ["a"]):
        rejects(completion, param="cache_salt", cache_salt=bad)
        rejects(chat, param="cache_salt", cache_salt=bad)
