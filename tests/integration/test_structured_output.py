"""Structured output and top_logprobs through the router and real prefill + decode processes.

- 50 seeded random JSON schemas (nested objects, arrays, enums, bounded numbers, required fields)
  on the built-in model: every reply parses and validates with jsonschema, streamed and not.
- json_object, regex and choice, on both APIs; n > 1 with a schema (each choice constrained).
- The form a migrated request takes (prompt + the k generated ids, num_generated = k): the new
  pair rebuilds the grammar's state from the ids and continues exactly (greedy, random model).
- top_logprobs: k alternatives per token, most likely first, from prefill (first token) and decode.
After each: queue gauges 0, KV pools whole.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.sampling_params import SamplingParams
from services.engine.grammar import GrammarRegistry, build_tokenizer
from services.fakes.random_schemas import random_schema
from services.fakes.worker_client import generate
from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import Mesh, mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
SCHEMAS = 50
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("structured"), router_flags=("--request-timeout", "120")) as (
        m, (p,), (d,), r
    ):
        yield m, p, d, r


def _post(r, path: str, body: dict) -> dict:
    return post_json(r.http_url, path, body, timeout=120)


def _stream(r, path: str, body: dict) -> list[dict]:
    return stream_events(r.http_url, path, body, timeout=120)


def _chat_body(seed: int, schema: dict) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Describe record {seed} as JSON."}],
        "max_tokens": MAX_TOKENS,
        "seed": seed,
        "temperature": 0.0 if seed % 5 == 0 else 0.8,  # mostly sampled, some greedy
        "response_format": {"type": "json_schema", "json_schema": {"name": f"record_{seed}", "schema": schema,
                                                                   "strict": True}},
    }


def _one_schema(r, seed: int) -> list[str]:
    """Both ways for one schema; returns the problems found (empty when all is well)."""
    schema = random_schema(seed)
    body = _chat_body(seed, schema)
    problems = []
    reply = _post(r, "/v1/chat/completions", body)["choices"][0]
    events = _stream(r, "/v1/chat/completions", body)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    for how, text, reason in (("plain", reply["message"]["content"], reply["finish_reason"]),
                              ("streamed", streamed, finish[-1] if finish else None)):
        try:
            assert reason == "stop", f"finish_reason {reason}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            problems.append(f"schema {seed} {how}: {type(e).__name__}: {str(e)[:200]} in {text[:300]!r}")
    return problems


def _random_schemas(mesh, count: int) -> None:
    m, p, d, r = mesh
    with ThreadPoolExecutor(8) as pool:
        problems = [x for found in pool.map(lambda s: _one_schema(r, s), range(count)) for x in found]
    assert not problems, "\n".join(problems)
    m.assert_invariants()


def test_ten_random_schemas_validate_streamed_and_not(mesh):
    _random_schemas(mesh, 10)  # make test's short form of the fifty below


@pytest.mark.long
def test_fifty_random_schemas_validate_streamed_and_not(mesh):
    _random_schemas(mesh, SCHEMAS)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_regex_and_choice(mesh, stream):
    m, p, d, r = mesh

    def text_of(path, body):
        if not stream:
            choice = _post(r, path, body)["choices"][0]
            return choice.get("text", (choice.get("message") or {}).get("content"))
        events = _stream(r, path, body)
        key = "text" if path.endswith("/completions") and "chat" not in path else None
        parts = [e["choices"][0][key] if key else e["choices"][0]["delta"].get("content") or ""
                 for e in events if e["choices"]]
        return "".join(parts)

    base = {"model": MODEL, "max_tokens": 200, "temperature": 0.9, "seed": 11}
    chat = {**base, "messages": [{"role": "user", "content": "An object, please."}]}
    phone = text_of("/v1/completions", {**base, "prompt": "Call me at ", "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), phone
    choices = ["red", "green", "blue and yellow"]
    for seed in range(4):
        picked = text_of("/v1/chat/completions", {**chat, "seed": seed, "guided_choice": choices})
        assert picked in choices
    m.assert_invariants()


def test_json_object_is_complete_or_a_valid_prefix(mesh):
    """Any JSON object: the tiny model likes to write prose inside a string value, so some replies
    reach max_tokens first. Those are cut (finish_reason "length", as OpenAI) but never leave the
    grammar: a byte-level matcher accepts every byte of them. Complete ones parse as objects."""
    m, p, d, r = mesh
    checker = GrammarRegistry(build_tokenizer(BuiltinTokenizer(), None, 264), 264)
    complete = 0
    for seed in range(8):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "An object, please."}], "max_tokens": 200,
                "temperature": 0.9, "seed": seed, "response_format": {"type": "json_object"}}
        choice = _post(r, "/v1/chat/completions", body)["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
            complete += 1
        else:
            assert choice["finish_reason"] == "length"
            matcher = checker.compile(("json_schema", '{"type": "object"}'))
            matcher.consume_tokens(list(text.encode()))
            assert not matcher.is_error(), text
    assert complete >= 1
    m.assert_invariants()


def test_n_choices_each_follow_the_schema(mesh):
    m, p, d, r = mesh
    schema = random_schema(1234)
    body = {**_chat_body(7, schema), "n": 3, "temperature": 1.0}
    choices = _post(r, "/v1/chat/completions", body)["choices"]
    assert len(choices) == 3
    for c in choices:
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    m.assert_invariants()


def test_top_logprobs_from_prefill_and_decode(mesh):
    m, p, d, r = mesh
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 4, "ignore_eos": True}
    for content in (_post(r, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"],
                    [c for e in _stream(r, "/v1/chat/completions", body) if e["choices"] and e["choices"][0]["logprobs"]
                     for c in e["choices"][0]["logprobs"]["content"]]):
        assert len(content) == 6
        for entry in content:  # the first one comes from prefill's reply, the rest from decode
            alts = entry["top_logprobs"]
            assert len(alts) == 4
            assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts), reverse=True)
            # greedy: the chosen token is the most likely one
            assert alts[0]["token"] == entry["token"] and alts[0]["logprob"] == pytest.approx(entry["logprob"])
    comp = _post(r, "/v1/completions", {"model": MODEL, "prompt": "The", "max_tokens": 4, "logprobs": 2,
                                         "temperature": 0.0, "ignore_eos": True})
    tops = comp["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 4 and all(1 <= len(t) <= 2 for t in tops)
    m.assert_invariants()


def test_migrated_form_rebuilds_the_grammar_state_and_continues_exactly(tmp_path):
    """Directly over gRPC on the random byte-level model (whose logits leave no near-ties): a
    request re-submitted as prompt + its first k generated ids with num_generated = k — what the
    router sends after a migration — continues with exactly the tokens of the uninterrupted run."""
    mesh = Mesh(tmp_path)
    try:
        p = mesh.start_prefill("--model", "builtin-random", wait=False)
        d = mesh.start_decode("--model", "builtin-random", wait=False)
        mesh.wait_healthy(p)
        mesh.wait_healthy(d)
        prompt = list(b"Give the record: ")
        schemas = [random_schema(s) for s in (5, 6, 7)]
        params = [SamplingParams(temperature=0.7, seed=s, max_tokens=400, stop_token_ids=(258, 262),
                                 grammar=("json_schema", json.dumps(x))) for s, x in enumerate(schemas)]

        async def run(prompts, ps):
            return await asyncio.gather(*(generate(p.grpc_addr, d.grpc_addr, pr, pa, timeout=90)
                                          for pr, pa in zip(prompts, ps, strict=True)))

        full = asyncio.run(run([prompt] * 3, params))
        for out, schema in zip(full, schemas, strict=True):
            assert out.ok, (out.prefill_error, out.decode_error)
            assert out.tokens[-1] in (258, 262), "the grammar ended the output with eos"
            jsonschema.validate(json.loads(bytes(out.tokens[:-1]).decode()), schema)
        k = 5
        moved = asyncio.run(run([prompt + o.tokens[:k] for o in full],
                                [replace(pa, max_tokens=400 - k, num_generated=k) for pa in params]))
        # without num_generated the grammar would restart at the first of the k ids: a new object
        restarted = asyncio.run(run([prompt + o.tokens[:k] for o in full],
                                    [replace(pa, max_tokens=400 - k) for pa in params]))
        for out, bad, ref in zip(moved, restarted, full, strict=True):
            assert out.ok and out.tokens == ref.tokens[k:]
            assert bad.ok and bad.tokens[0] == ord("{") != ref.tokens[k]
        mesh.assert_invariants()
    finally:
        mesh.close()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_on_a_model_without_a_tool_format(mesh, stream):
    """The built-in model's chat template shows no tool-call format: `auto` is refused, but a named
    function (or `required`) works — the grammar forces a plain JSON call — through the openai SDK."""
    import openai

    m, p, d, r = mesh
    client = openai.OpenAI(base_url=r.http_url + "/v1", api_key="unused", max_retries=0)
    params = WEATHER["function"]["parameters"]
    for seed, choice in ((1, {"type": "function", "function": {"name": "get_weather"}}), (2, "required")):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  tool_choice=choice, seed=seed, max_tokens=200, parallel_tool_calls=False)
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for delta in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            got = list(calls.values())
        else:
            choice_out = client.chat.completions.create(**kw).choices[0]
            finish = choice_out.finish_reason
            got = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice_out.message.tool_calls]
        # "tool_calls" for required; a call forced by name finishes "stop", as OpenAI and vLLM answer it
        assert finish == ("tool_calls" if choice == "required" else "stop"), finish
        assert len(got) == 1 and got[0]["name"] == "get_weather"
        jsonschema.validate(json.loads(got[0]["arguments"]), params)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    m.assert_invariants()
