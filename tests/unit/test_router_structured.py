"""Structured output requests (services/router/structured.py): every accepted spelling becomes one
(kind, source) grammar that compiles; every bad one is a 400 naming its field."""

from __future__ import annotations

import json

import pytest

from services.common.grammar_spec import validate
from tests.unit.test_router_protocol import chat, completion, rejects

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("parse", [chat, completion])
def test_response_format_spellings(parse):
    assert parse().grammar is None
    assert parse(response_format={"type": "text"}).grammar is None
    assert parse(response_format={"type": "json_object"}).grammar == ("json_schema", '{"type": "object"}')
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    kind, source = parse(response_format=fmt).grammar
    assert kind == "json_schema" and json.loads(source) == SCHEMA
    # no schema: any JSON value, as OpenAI
    assert parse(response_format={"type": "json_schema", "json_schema": {"name": "x"}}).grammar == ("json_schema", "{}")


def test_vllm_extras():
    assert chat(structured_outputs={"regex": "[0-9]+"}).grammar == ("regex", "[0-9]+")
    assert chat(guided_regex="[0-9]+").grammar == ("regex", "[0-9]+")
    assert json.loads(chat(guided_json=json.dumps(SCHEMA)).grammar[1]) == SCHEMA
    assert json.loads(completion(structured_outputs={"json": SCHEMA}).grammar[1]) == SCHEMA
    kind, source = chat(structured_outputs={"choice": ["yes", 'no "way"']}).grammar
    assert kind == "lark" and validate(kind, source) is None and '"no \\"way\\""' in source
    assert chat(guided_grammar='start: "a"+').grammar == ("lark", 'start: "a"+')


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
         "response_format.json_schema.strict"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": "a"}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_structured_output(kw, param):
    rejects(chat, param=param, **kw)
