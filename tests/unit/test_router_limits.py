"""What one request may send the workers (services/router/limits.py): a grammar past
--max-grammar-bytes and a request whose n × (prompt ids + grammar) passes
--max-request-worker-bytes are 400s naming the limit, before any grammar is compiled."""

from __future__ import annotations

import json

import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.router.errors import APIError
from services.router.limits import RequestLimits, call_bytes
from services.router.protocol import ModelInfo, parse_chat, parse_completion

TOK = BuiltinTokenizer()
LIMITS = RequestLimits(max_grammar_bytes=20_000, max_request_worker_bytes=200_000)
INFO = ModelInfo(name="m", tokenizer=TOK, context_length=4096, limits=LIMITS)
MSGS = [{"role": "user", "content": "hi"}]


def _schema(properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i:05d}": {"type": "string", "description": "d" * 40}
                                             for i in range(properties)}}


def _tool(properties: int) -> dict:
    return {"type": "function", "function": {"name": "big", "parameters": _schema(properties)}}


def _refused(fn, body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body, INFO)
    assert e.value.status == 400
    return e.value


def test_a_forced_tool_call_with_schemas_past_the_grammar_limit_is_refused_uncompiled(monkeypatch):
    compiled = []
    monkeypatch.setattr("services.router.tools.validate", lambda *a: compiled.append(a))
    body = {"model": "m", "messages": MSGS, "tools": [_tool(400)], "tool_choice": "required", "max_tokens": 4}
    error = _refused(parse_chat, body)
    assert error.code == "grammar_too_large" and error.param == "tools"
    assert "--max-grammar-bytes" in error.message and "20000" in error.message
    assert not compiled


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_regex"])
def test_a_structured_output_grammar_past_the_limit_is_refused(field):
    if field == "response_format":
        value = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(400)}}
    elif field == "structured_outputs":
        value = {"regex": "a" * 30_000}
    else:
        value = "a" * 30_000
    error = _refused(parse_chat, {"model": "m", "messages": MSGS, field: value, "max_tokens": 4})
    assert error.code == "grammar_too_large" and error.param == field


def test_n_times_grammar_past_the_request_limit_is_refused_one_choice_is_not():
    schema = _schema(100)  # ~6.5 kB: under the grammar limit
    assert len(json.dumps(schema)) < LIMITS.max_grammar_bytes
    body = {"model": "m", "messages": MSGS, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert parse_chat({**body, "n": 1}, INFO).grammar is not None
    error = _refused(parse_chat, {**body, "n": 16})
    assert error.code == "request_too_large" and error.param == "n"
    assert "--max-request-worker-bytes" in error.message


def test_prompt_ids_count_toward_the_request_limit():
    ids = [65] * 3000  # 3000 ids × 5 bytes × 16 choices > 200 kB
    assert parse_completion({"model": "m", "prompt": ids, "max_tokens": 1}, INFO).n == 1
    error = _refused(parse_completion, {"model": "m", "prompt": ids, "max_tokens": 1, "n": 16})
    assert error.code == "request_too_large"
    assert 16 * call_bytes(3000, None) > LIMITS.max_request_worker_bytes


def test_default_limits_carry_ordinary_requests():
    info = ModelInfo(name="m", tokenizer=TOK, context_length=4096)
    spec = parse_chat({"model": "m", "messages": MSGS, "n": 16, "max_tokens": 4, "tools": [_tool(50)],
                       "tool_choice": "required"}, info)
    assert spec.grammar is not None and spec.n == 16
