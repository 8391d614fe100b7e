"""The served model's controls with vLLM's names: several --served-model-name, --max-model-len,
--chat-template, generation_config.json defaults and --override-generation-config, --max-logprobs,
--response-role, and a default max_tokens the decode pool holds."""

from __future__ import annotations

import json

import httpx
import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.router import model_controls
from services.router.errors import APIError
from services.router.protocol import ModelInfo, parse_chat, parse_completion
from tests.unit.test_router_app import cluster_factory  # noqa: F401 - fixture
from tests.unit.test_tokenizer import build_llama3_folder

TOK = BuiltinTokenizer()
MSGS = [{"role": "user", "content": "hi"}]


def test_generation_defaults_apply_unless_the_request_sets_them(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_new_tokens": 7, "eos_token_id": 3, "do_sample": True}))
    defaults = model_controls.generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                        "max_tokens": 7}
    assert model_controls.generation_defaults(str(tmp_path), "vllm") == {}
    info = ModelInfo(name="m", tokenizer=TOK, context_length=64, defaults=defaults)
    spec = parse_chat({"model": "m", "messages": MSGS}, info)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.repetition_penalty, spec.max_tokens) == (
        0.6, 0.9, 20, 0.05, 1.1, 7)
    spec = parse_chat({"model": "m", "messages": MSGS, "temperature": 0, "top_k": -1, "max_tokens": 30}, info)
    assert (spec.temperature, spec.top_k, spec.max_tokens) == (0.0, 0, 30)
    # completions keep OpenAI's default of 16 tokens; the sampling defaults still apply
    spec = parse_completion({"model": "m", "prompt": "x"}, info)
    assert spec.max_tokens == 16 and spec.temperature == 0.6
    # a default max_tokens is capped by what is left of the context, never refused
    short = ModelInfo(name="m", tokenizer=TOK, context_length=12, defaults=defaults)
    assert parse_chat({"model": "m", "messages": MSGS}, short).max_tokens < 7


def test_the_builtin_model_has_no_sampling_defaults():
    assert model_controls.generation_defaults("builtin") == {}
    assert model_controls.generation_defaults("builtin-random") == {}


def test_default_max_tokens_fits_the_decode_pool():
    info = ModelInfo(name="m", tokenizer=TOK, context_length=4096, capacity=lambda: 100)
    spec = parse_chat({"model": "m", "messages": MSGS}, info)
    assert spec.max_tokens == 100 - len(spec.prompt_ids)
    # an explicit max_tokens is the client's: the workers refuse what they can never hold
    assert parse_chat({"model": "m", "messages": MSGS, "max_tokens": 500}, info).max_tokens == 500
    unknown = ModelInfo(name="m", tokenizer=TOK, context_length=4096, capacity=lambda: None)
    assert parse_chat({"model": "m", "messages": MSGS}, unknown).max_tokens == 4096 - len(spec.prompt_ids)


def test_max_model_len_and_chat_template_flags(tmp_path):
    assert model_controls.max_model_len(0, 8192) == 8192
    assert model_controls.max_model_len(2048, 8192) == 2048
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model_controls.max_model_len(10000, 8192)
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert model_controls.chat_template(str(f)) == "{{ messages[0].content }}"
    assert model_controls.chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError):
        model_controls.chat_template("/no/such/file")
    assert model_controls.served_names("m", ["a", "b", "a"], "d") == ["a", "b"]
    assert model_controls.served_names("m", [], "d") == ["d"]


def test_router_serves_several_names_its_length_and_template(cluster_factory, tmp_path):  # noqa: F811
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    c = cluster_factory(served_model_name=["first", "second"], max_model_len=40, chat_template=str(template))
    models = httpx.get(c.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["first", "second"] and models[0]["max_model_len"] == 40
    # vLLM's card: every served name comes from the same --model, with no base model
    assert {m["root"] for m in models} == {c.router.info.root} and c.router.info.root
    assert all(m["parent"] is None for m in models)
    assert httpx.get(c.url + "/v1/models/second").json()["id"] == "second"
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for name in ("first", "second"):
        r = httpx.post(c.url + "/v1/chat/completions", json={**body, "model": name})
        assert r.status_code == 200 and r.json()["model"] == "first"
    tokens = httpx.post(c.url + "/tokenize", json=body).json()
    assert tokens["tokens"] == TOK.encode("[hello]", add_special_tokens=False) and tokens["max_model_len"] == 40
    r = httpx.post(c.url + "/v1/completions", json={"model": "first", "prompt": "x" * 30, "max_tokens": 20})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert 'model_name="first"' in httpx.get(c.url + "/metrics").text
    c.all_rpcs_ended()


def test_an_hf_folder_with_generation_defaults(tmp_path):
    folder = build_llama3_folder(tmp_path / "llama")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8}))
    assert model_controls.generation_defaults(str(folder)) == {"temperature": 0.7, "top_p": 0.8}


def test_override_generation_config_sets_and_replaces_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    overrides = model_controls.generation_overrides('{"temperature": 0.2, "max_new_tokens": 5, "top_k": 20}')
    assert overrides == {"temperature": 0.2, "max_tokens": 5, "top_k": 20}
    defaults = {**model_controls.generation_defaults(str(tmp_path)), **overrides}
    spec = parse_chat({"model": "m", "messages": MSGS},
                      ModelInfo(name="m", tokenizer=TOK, context_length=64, defaults=defaults))
    assert (spec.temperature, spec.top_p, spec.top_k, spec.max_tokens) == (0.2, 0.9, 20, 5)
    assert model_controls.generation_overrides("") == {}
    for bad, why in [("{", "not valid JSON"), ("[1]", "JSON object"), ('{"temp": 1}', "unknown key"),
                     ('{"temperature": 2.5}', "from 0.0 to 2.0"), ('{"top_k": 1.5}', "whole number"),
                     ('{"max_new_tokens": 0}', "max_new_tokens"), ('{"top_p": "high"}', "top_p"),
                     ('{"repetition_penalty": 0}', "repetition_penalty")]:
        with pytest.raises(ValueError, match=why):
            model_controls.generation_overrides(bad)


def test_router_applies_the_override_to_requests_that_leave_the_field_out(cluster_factory):  # noqa: F811
    c = cluster_factory(override_generation_config='{"max_new_tokens": 3}')
    body = {"model": c.router.info.name, "messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(c.url + "/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3
    own = httpx.post(c.url + "/v1/chat/completions", json={**body, "max_tokens": 5}).json()
    assert own["usage"]["completion_tokens"] == 5
    c.all_rpcs_ended()


def test_max_logprobs_caps_every_logprobs_field():
    assert model_controls.max_logprobs(20) == 20 and model_controls.max_logprobs(0) == 0
    for bad in (-1, 21):  # vLLM's -1 is the whole vocabulary, which the workers cannot return
        with pytest.raises(ValueError, match="--max-logprobs"):
            model_controls.max_logprobs(bad)
    info = ModelInfo(name="m", tokenizer=TOK, context_length=64, max_logprobs=5)
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 5, "prompt_logprobs": 5}, info).logprobs == 5
    assert parse_chat({"model": "m", "messages": MSGS, "logprobs": True, "top_logprobs": 5}, info).logprobs == 5
    for parse, body, field in [(parse_completion, {"prompt": "x", "logprobs": 6}, "logprobs"),
                               (parse_completion, {"prompt": "x", "prompt_logprobs": 6}, "prompt_logprobs"),
                               (parse_chat, {"messages": MSGS, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
                               (parse_chat, {"messages": MSGS, "prompt_logprobs": 6}, "prompt_logprobs")]:
        with pytest.raises(APIError) as e:
            parse({"model": "m", **body}, info)
        assert e.value.status == 400 and e.value.param == field and "at most 5" in e.value.message


def test_response_role_after_a_generation_prompt_else_the_continued_message_s():
    info = ModelInfo(name="m", tokenizer=TOK, context_length=64, response_role="bot")
    assert parse_chat({"model": "m", "messages": MSGS}, info).role == "bot"
    assert parse_chat({"model": "m", "messages": MSGS}, ModelInfo(name="m", tokenizer=TOK, context_length=64)).role \
        == "assistant"
    turns = [*MSGS, {"role": "assistant", "content": "Hel"}]
    assert parse_chat({"model": "m", "messages": turns, "continue_final_message": True,
                       "add_generation_prompt": False}, info).role == "assistant"
    assert parse_chat({"model": "m", "messages": MSGS, "add_generation_prompt": False}, info).role == "user"


def test_router_answers_with_the_response_role(cluster_factory):  # noqa: F811
    c = cluster_factory(response_role="bot", max_logprobs=3)
    body = {"model": c.router.info.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    assert httpx.post(c.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "bot"
    r = httpx.post(c.url + "/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    c.all_rpcs_ended()


def test_seed_flag_makes_unseeded_requests_repeat():
    from services.common.random_bits import SeededBits

    def seeds(draw):
        info = ModelInfo(name="m", tokenizer=TOK, context_length=64, draw_seed=draw)
        return [parse_chat({"model": "m", "messages": MSGS}, info).seed for _ in range(3)]

    assert seeds(SeededBits(7)) == seeds(SeededBits(7))  # the same requests, in order, after a restart
    assert seeds(SeededBits(7)) != seeds(SeededBits(8))
    assert len(set(seeds(SeededBits(7)))) == 3  # each request its own
    assert len(set(seeds(lambda: 5))) == 1 and seeds(lambda: 5)[0] == 5
    # a request's own seed wins
    info = ModelInfo(name="m", tokenizer=TOK, context_length=64, draw_seed=SeededBits(7))
    assert parse_chat({"model": "m", "messages": MSGS, "seed": 42}, info).seed == 42


def test_router_with_a_seed_repeats_its_text_after_a_restart(cluster_factory):  # noqa: F811
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}

    def run():
        c = cluster_factory(seed=11)
        body["model"] = c.router.info.name
        httpx.post(c.url + "/v1/chat/completions", json=body)
        seeds = [r.params.seed for r in c.decodes[0].seen.requests]
        c.all_rpcs_ended()
        return seeds

    first, again = run(), run()
    assert first == again and len(first) == 1
