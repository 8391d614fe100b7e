"""vLLM's request fields, walked one by one: each is implemented (and changes what vLLM says it
changes), informational (accepted, changes nothing), or refused with a 400 naming it.

The lists are the fields of vLLM's ChatCompletionRequest and CompletionRequest at
VLLM_PROTOCOL (vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py,
which replaced vllm/entrypoints/openai/protocol.py). A field vLLM adds later fails
`test_every_field_is_classified` until it is classified here and in the router.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.tokenizer import load_tokenizer
from services.router.errors import APIError
from services.router.orchestrator import sampling_params
from services.router.protocol import ModelInfo, parse_chat, parse_completion
from services.router.request_fields import CHAT, INFORMATIONAL, REFUSED

VLLM_PROTOCOL = "vllm-project/vllm main @ 002032ee2b18 (the 0.3x protocol modules)"

VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
    "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval",
)
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
    "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval",
)

TOK = load_tokenizer("builtin")
# --scheduling-policy priority, so that `priority` is served (under fcfs only 0 is: see
# test_priority_needs_the_priority_policy)
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=256, tool_parser="hermes", scheduling_policy="priority")
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
EFFORT_TEMPLATE = "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
DOCS_TEMPLATE = "{% for d in documents or [] %}{{ d.text }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
KWARGS_TEMPLATE = "{{ flavour }}{% for m in messages %}{{ m.content }}{% endfor %}"


def _wire(spec):
    return sampling_params(spec, TOK.eos_token_ids)


def _ids(spec):
    return spec.prompt_ids


# field -> (extra fields of both bodies, the field's value, what must differ from the body without it)
SHARED_EFFECTS = {
    "model": ({}, "m", None),  # optional: left out, the served model (test_a_missing_model_is_the_served_one)
    "frequency_penalty": ({}, 0.5, lambda s: _wire(s).frequency_penalty),
    "presence_penalty": ({}, 0.5, lambda s: _wire(s).presence_penalty),
    "logit_bias": ({}, {"5": 3}, lambda s: _wire(s).logit_bias),
    "n": ({}, 3, lambda s: s.n),
    "seed": ({}, 42, lambda s: _wire(s).seed),
    "stop": ({}, ["zz"], lambda s: s.stop),
    "stream": ({}, True, lambda s: s.stream),
    "stream_options": ({"stream": True}, {"include_usage": True, "continuous_usage_stats": True},
                       lambda s: (s.include_usage, s.continuous_usage)),
    "temperature": ({}, 0.5, lambda s: _wire(s).temperature),
    "top_p": ({}, 0.5, lambda s: _wire(s).top_p),
    "top_k": ({}, 5, lambda s: _wire(s).top_k),
    "min_p": ({}, 0.1, lambda s: _wire(s).min_p),
    "repetition_penalty": ({}, 1.3, lambda s: _wire(s).repetition_penalty),
    "stop_token_ids": ({}, [7], lambda s: _wire(s).stop_token_ids),
    "include_stop_str_in_output": ({"stop": ["a"]}, True, lambda s: s.include_stop_str_in_output),
    "ignore_eos": ({}, True, lambda s: _wire(s).stop_token_ids),
    "min_tokens": ({}, 2, lambda s: _wire(s).min_tokens),
    "skip_special_tokens": ({}, False, lambda s: s.skip_special_tokens),
    "truncate_prompt_tokens": ({}, 2, _ids),
    "truncation_side": ({"truncate_prompt_tokens": 2}, "right", _ids),
    "allowed_token_ids": ({}, [3, 4], lambda s: _wire(s).allowed_token_ids),
    "bad_words": ({}, ["hello"], lambda s: _wire(s).bad_words),
    "response_format": ({}, SCHEMA, lambda s: _wire(s).grammar),
    "structured_outputs": ({}, {"regex": "[ab]+"}, lambda s: _wire(s).grammar),
    "request_id": ({}, "abc", lambda s: s.request_id),
    "return_tokens_as_token_ids": ({}, True, lambda s: s.tokens_as_ids),
    "return_token_ids": ({}, True, lambda s: s.return_token_ids),
    "prompt_logprobs": ({}, 2, lambda s: _wire(s).prompt_logprobs),
    "cache_salt": ({}, "tenant-7f3a", lambda s: _wire(s).cache_salt),
    "stream_interval": ({"stream": True}, 4, lambda s: s.stream_interval),
    "priority": ({}, -5, lambda s: _wire(s).priority),
    "use_beam_search": ({}, True, lambda s: s.beam_search),
    "length_penalty": ({"use_beam_search": True}, 0.5, lambda s: s.length_penalty),
}
CHAT_EFFECTS = {
    **SHARED_EFFECTS,
    "messages": ({}, [{"role": "user", "content": "other"}], _ids),
    "logprobs": ({}, True, lambda s: s.logprobs),
    "top_logprobs": ({"logprobs": True}, 3, lambda s: _wire(s).top_logprobs),
    "max_tokens": ({}, 5, lambda s: _wire(s).max_tokens),
    "max_completion_tokens": ({}, 5, lambda s: _wire(s).max_tokens),
    "tools": ({}, [TOOL], lambda s: s.tool_parser),
    "tool_choice": ({"tools": [TOOL]}, "required", lambda s: _wire(s).grammar),
    "parallel_tool_calls": ({"tools": [TOOL], "tool_choice": "required"}, False, lambda s: _wire(s).grammar),
    "reasoning_effort": ({"chat_template": EFFORT_TEMPLATE}, "low", _ids),
    "echo": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "The"}]}, True,
             lambda s: s.echo_text),
    "add_generation_prompt": ({}, False, _ids),
    "continue_final_message": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                 "content": "The"}],
                                "add_generation_prompt": False}, True, _ids),
    "add_special_tokens": ({}, True, _ids),
    "documents": ({"chat_template": DOCS_TEMPLATE}, [{"title": "t", "text": "doc"}], _ids),
    "chat_template": ({}, "{% for m in messages %}[{{ m.content }}]{% endfor %}", _ids),
    "chat_template_kwargs": ({"chat_template": KWARGS_TEMPLATE}, {"flavour": "salty"}, _ids),
}
COMPLETION_EFFECTS = {
    **SHARED_EFFECTS,
    "prompt": ({}, "other text", _ids),
    "echo": ({}, True, lambda s: s.echo_text),
    "logprobs": ({}, 2, lambda s: _wire(s).top_logprobs),
    "max_tokens": ({}, 5, lambda s: _wire(s).max_tokens),
    "add_special_tokens": ({}, False, _ids),
}
# a refused field's value that asks for what is not supported
REFUSED_VALUES = {
    "watermarking": True, "spaces_between_special_tokens": False,
    "logprob_token_ids": [1], "prompt_embeds": "AAAA", "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1},
    "return_token_offsets": True, "return_prompt_text": True, "return_mm_kwargs": False,
    "routed_experts_prompt_start": 1, "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"n": 3},
    "thinking_token_budget": 10, "include_reasoning": False, "suffix": "tail",
}
INFORMATIONAL_VALUES = {"user": "u-1", "session_id": "s-1", "metadata": {"k": "v"}, "store": False,
                        "safety_identifier": "h-1", "prediction": {"type": "content", "content": "x"},
                        "prompt_cache_key": "k-1", "service_tier": "auto"}


def _unlogged(spec):
    return replace(spec, session_id=None)  # session_id goes to the request's log line, nowhere else


def _chat(**kw):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hello"}], "seed": 1, **kw}, INFO)


def _completion(**kw):
    return parse_completion({"model": "m", "prompt": "hello world", "seed": 1, **kw}, INFO)


ROUTES = {"chat": (_chat, VLLM_CHAT_FIELDS, CHAT_EFFECTS), "completion": (_completion, VLLM_COMPLETION_FIELDS,
                                                                          COMPLETION_EFFECTS)}


@pytest.mark.parametrize("kind", ROUTES)
def test_every_field_is_classified(kind):
    _, fields, effects = ROUTES[kind]
    for name in fields:
        homes = [name in effects, name in INFORMATIONAL, name in REFUSED and kind in REFUSED[name].kinds]
        assert sum(homes) == 1, f"{kind} field {name!r} ({VLLM_PROTOCOL}): implemented/informational/refused {homes}"


def _cases(kind):
    return [(kind, name) for name in ROUTES[kind][1]]


@pytest.mark.parametrize("kind,name", _cases("chat") + _cases("completion"))
def test_each_field_does_what_vllm_says(kind, name):
    parse, _, effects = ROUTES[kind]
    if name in effects:
        extra, value, observe = effects[name]
        changed = parse(**{**extra, name: value})
        if observe is not None:
            base = parse(**{k: v for k, v in extra.items() if k != name})
            assert observe(changed) != observe(base), f"{name}={value!r} changed nothing"
    elif name in INFORMATIONAL:
        assert _unlogged(parse(**{name: INFORMATIONAL_VALUES[name]})) == parse()
    else:
        with pytest.raises(APIError) as err:
            parse(**{name: REFUSED_VALUES[name]})
        assert err.value.status == 400 and err.value.param == name and name in err.value.message
        parse(**{name: None})  # null (not asked for) is accepted


@pytest.mark.parametrize("kind", ROUTES)
def test_openai_informational_fields_are_accepted(kind):
    parse = ROUTES[kind][0]
    for name, value in INFORMATIONAL_VALUES.items():
        assert _unlogged(parse(**{name: value})) == parse()


def test_refused_defaults_sent_explicitly_are_accepted():
    _chat(use_beam_search=False, length_penalty=1.0, include_reasoning=True,
          spaces_between_special_tokens=True, return_prompt_text=False, return_mm_kwargs=True)
    _completion(suffix="", thinking_token_budget=-1, routed_experts_prompt_start=0)
    with pytest.raises(APIError):
        _chat(priority=True)  # a boolean is not an integer


def test_priority_needs_the_priority_policy():
    fcfs = replace(INFO, scheduling_policy="fcfs")
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert parse_chat({**body, "priority": 0}, fcfs).priority == 0  # the default, sent explicitly
    for parse, b in ((parse_chat, body), (parse_completion, {"model": "m", "prompt": "x"})):
        with pytest.raises(APIError) as err:
            parse({**b, "priority": 1}, fcfs)
        assert err.value.status == 400 and err.value.param == "priority" and "--scheduling-policy" in err.value.message
    for bad in (1 << 31, -(1 << 31) - 1, 1.5):  # vLLM's is a 32-bit integer
        with pytest.raises(APIError):
            _chat(priority=bad)
    assert _chat(priority=-(1 << 31)).priority == -(1 << 31)


# OpenAI's chat request (Create chat completion) beyond vLLM's list, and the deprecated pair refused
# in services/router/tools.py
OPENAI_ONLY_CHAT_FIELDS = ("audio", "modalities", "prediction", "prompt_cache_key", "safety_identifier",
                           "service_tier", "store", "metadata", "verbosity", "web_search_options")


def test_every_openai_chat_field_is_classified():
    for name in OPENAI_ONLY_CHAT_FIELDS:
        homes = [name in VLLM_CHAT_FIELDS, name in INFORMATIONAL, name in REFUSED and CHAT in REFUSED[name].kinds]
        assert sum(homes) == 1, f"OpenAI chat field {name!r}: vLLM's/informational/refused {homes}"


@pytest.mark.parametrize("name, value", [
    ("modalities", ["text", "audio"]), ("modalities", ["audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("web_search_options", {}), ("verbosity", "low"),
])
def test_openai_fields_asking_for_more_than_text_are_refused(name, value):
    """OpenAI's chat fields for audio output or web search: a 200 with text alone would hide that
    they were not honoured."""
    with pytest.raises(APIError) as err:
        _chat(**{name: value})
    assert err.value.status == 400 and err.value.param == name and name in err.value.message


def test_openai_text_only_defaults_are_accepted():
    assert _unlogged(_chat(modalities=["text"])) == _chat()
    assert _unlogged(_chat(audio=None, web_search_options=None, modalities=None, verbosity="medium")) == _chat()
