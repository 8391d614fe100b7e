"""Tool calls with the openai SDK through router + prefill + decode processes.

The model is a tiny random Qwen2 with a Qwen2.5-style tool-calling chat template
(services/fakes/hf_checkpoints.py, built offline with transformers): the router detects the `hermes`
format from the template. A random model never calls a tool by itself, so what is checked is
what the router and the grammar engine guarantee:

- tool_choice naming a function, streamed and not: the SDK returns one `tool_calls` entry for it
  whose arguments parse and validate (jsonschema) against the function's parameters;
- tool_choice required: one call of one of the tools, valid the same way;
- auto and none: the tools are rendered into the prompt (prompt_tokens), the reply is parsed
  (auto) or not (none); a conversation with an assistant's tool_calls and tool results renders;
- n = 2 and a stop string with a forced call.

The forced-call tests need the workers' grammar engine (services/engine/grammar.py): without it
the random model writes noise and they fail, by design, rather than skip.
"""

from __future__ import annotations

import json
import re

import pytest

from services.common.tokenizer import load_tokenizer
from services.router.tools import marker_term
from tests.integration.mesh import mesh_with_router

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
        "exact": {"type": "boolean"},
    },
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
MAX_TOKENS = 120  # a forced call of these schemas is well under 100 tokens


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from services.fakes.hf_checkpoints import save_tiny_qwen2_tools

    folder = save_tiny_qwen2_tools(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-tools")
    model = ("--model", str(folder))
    with mesh_with_router(tmp_path_factory.mktemp("tools-mesh"), 1, 1, model, model,
                          (*model, "--request-timeout", "60")) as (m, ps, ds, r):
        yield m, r, folder, ps, ds


@pytest.fixture(scope="module")
def thinking(mesh):
    """A second router on the same workers, telling Qwen3-style <think>...</think> apart."""
    m, _, folder, ps, ds = mesh
    r = m.start_router(ps, ds, "--model", str(folder), "--request-timeout", "60", "--reasoning-parser", "qwen3")
    return openai.OpenAI(base_url=r.http_url + "/v1", api_key="unused", max_retries=0, timeout=90)


@pytest.fixture(scope="module")
def client(mesh):
    r = mesh[1]
    return openai.OpenAI(base_url=r.http_url + "/v1", api_key="unused", max_retries=0, timeout=90)


@pytest.fixture(scope="module")
def model(mesh):
    return mesh[2].name


def assert_valid_call(call, names=("get_weather",)):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_model_card_names_the_parser(client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.model_extra["tool_call_parser"] == "hermes"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_function_non_streamed(client, model, seed):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=seed, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.message.tool_calls, f"no tool call parsed from {choice.message.content!r}"
    # a call forced by name finishes "stop", as OpenAI and vLLM answer it
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop"
    assert_valid_call(choice.message.tool_calls[0])
    assert choice.message.content is None


@pytest.mark.parametrize("seed", [4, 5])
def test_named_function_streamed(client, model, seed):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=seed, temperature=1.0,
              tool_choice={"type": "function", "function": {"name": "search"}})
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.message.tool_calls, f"no tool call streamed; content {choice.message.content!r}"
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop"
    streamed = assert_valid_call(choice.message.tool_calls[0], names=("search",))
    # the same request, not streamed, gives the same call (same seed, same tokens)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    assert json.loads(whole.function.arguments) == streamed
    # and the raw chunks are shaped as OpenAI's: id, type and name first, then argument fragments
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "search"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_tools(client, model, stream):
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=11, temperature=1.0,
              tool_choice="required", parallel_tool_calls=False)
    if stream:
        with client.chat.completions.stream(**kw) as s:
            choice = s.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1, choice.message
    assert_valid_call(choice.message.tool_calls[0], names=tuple(SCHEMAS))
    assert choice.finish_reason == "tool_calls"


def test_n2_and_a_stop_string_with_a_forced_call(client, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=21, n=2, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0])
    # streamed: each choice's deltas (by choice index, then call index) assemble to its call
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=21, n=2, temperature=1.0,
        stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    for choice in out.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        deltas = [tc for c in mine for tc in c.delta.tool_calls or []]
        assert deltas and {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in deltas) == choice.message.tool_calls[0].function.arguments
        assert mine[-1].finish_reason == "stop"
    # a stop string that cuts the closing marker: the call is whole all the same
    cut = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=21, temperature=1.0,
        stop=["</tool_call>"], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert cut.choices[0].message.tool_calls and cut.choices[0].finish_reason == "stop"
    assert json.loads(cut.choices[0].message.tool_calls[0].function.arguments) == json.loads(
        out.choices[0].message.tool_calls[0].function.arguments)


def test_auto_and_none_render_the_tools(mesh, client, model):
    folder = mesh[2]
    tok = load_tokenizer(str(folder))
    with_tools = len(tok.encode_chat(MESSAGES, tools=TOOLS))
    assert with_tools > len(tok.encode_chat(MESSAGES)) + 50
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             max_tokens=16, seed=3)
        assert out.usage.prompt_tokens == with_tools
        msg = out.choices[0].message
        if choice == "none":
            assert msg.tool_calls is None and isinstance(msg.content, str)
        else:  # a random model: whatever it wrote is content, or well-formed calls
            for call in msg.tool_calls or []:
                json.loads(call.function.arguments)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # streamed auto: the content is the same as the non-streamed reply's
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=24, seed=8, temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0].message
    chunks = list(client.chat.completions.create(**kw, stream=True))  # the SDK's stream() refuses "length"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (content or None) == (whole.content or None)
    streamed_calls = {tc.index for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []}
    assert len(streamed_calls) == len(whole.tool_calls or [])


def test_conversation_with_tool_results(mesh, client, model):
    folder = mesh[2]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, seed=1)
    tok = load_tokenizer(str(folder))
    rendered = tok.apply_chat_template(
        [messages[0], {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
         messages[2]], tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in rendered
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in rendered
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_bad_tool_requests_are_400(client, model):
    cases = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tools=[{"type": "function", "function": {"description": "no name"}}]),
        dict(tool_choice="required"),
        dict(tools=TOOLS, tool_choice="sometimes"),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kw)
        assert e.value.status_code == 400


# A random model never thinks by itself, nor ever writes </think>: a regex grammar makes it write a
# thought, then an answer. The request's template ends with a closed thought (Qwen3's with
# enable_thinking false), so the router leaves that grammar as it is — it would otherwise let the
# model think freely first — and the reply's leading <think> still opens the reasoning.
OFF_TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n\n</think>\n\n"
THOUGHT = {"structured_outputs": {"regex": "<think>[a-z ]{3,24}</think>[a-z ]{3,24}"}, "chat_template": OFF_TEMPLATE}


def test_reasoning_is_told_apart(thinking, client, model):
    assert thinking.models.retrieve(model).model_extra["reasoning_parser"] == "qwen3"
    assert client.models.retrieve(model).model_extra["reasoning_parser"] is None
    kw = dict(model=model, messages=MESSAGES, max_tokens=80, seed=5, temperature=1.0, extra_body=THOUGHT)
    msg = thinking.chat.completions.create(**kw).choices[0].message
    extra = msg.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] and re.fullmatch("[a-z ]{3,24}", extra["reasoning"])
    assert re.fullmatch("[a-z ]{3,24}", msg.content), msg.content
    # the router without a parser answers the same text whole; no reasoning field
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.content == f"<think>{extra['reasoning']}</think>{msg.content}"
    assert "reasoning" not in (whole.model_extra or {})
    # streamed: the thinking's deltas first, then the answer's, adding up to the same
    chunks = list(thinking.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == extra["reasoning"]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == extra["reasoning"]
    assert "".join(d.content or "" for d in deltas) == msg.content
    # include_reasoning false: the answer alone
    quiet = thinking.chat.completions.create(**{**kw, "extra_body": {**THOUGHT, "include_reasoning": False}})
    assert quiet.choices[0].message.content == msg.content
    assert quiet.choices[0].message.model_extra.get("reasoning") is None
    # a reply that does not think is all content
    plain = thinking.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=5)
    assert plain.choices[0].message.model_extra.get("reasoning") is None
    assert plain.choices[0].message.content


def test_tool_calls_after_the_thinking(mesh, thinking, model):
    # the call's markers are tokens of their own, which a grammar names by id
    marker = marker_term(load_tokenizer(str(mesh[2])))
    head, tail = json.dumps('\n{"name": "search", "arguments": {"query": "'), json.dumps('"}}\n')
    grammar = (f'start: "<think>" /[a-z ]{{3,24}}/ "</think>" {marker("<tool_call>")} {head} /[a-z]{{1,8}}/ {tail} '
               f'{marker("</tool_call>")}')
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=7, temperature=1.0,
              extra_body={"structured_outputs": {"grammar": grammar}, "chat_template": OFF_TEMPLATE})
    choice = thinking.chat.completions.create(**kw).choices[0]
    assert re.fullmatch("[a-z ]{3,24}", choice.message.model_extra["reasoning"])
    assert choice.message.tool_calls, (choice.message, choice.finish_reason)
    assert [c.function.name for c in choice.message.tool_calls] == ["search"]
    assert_valid_call(choice.message.tool_calls[0], names=("search",))
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    chunks = list(thinking.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].function.name == "search"
    assert "".join(c.function.arguments or "" for c in calls) == choice.message.tool_calls[0].function.arguments


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


def test_a_grammar_holds_after_a_free_thought(mesh, thinking, model):
    tok = load_tokenizer(str(mesh[2]))
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    # the model may open a thought or answer at once: pushed towards "{", it answers at once, and
    # the answer follows the schema
    brace = {str(t): 100 for t in (*tok.encode("{", add_special_tokens=False), *tok.encode('{"', add_special_tokens=False))}
    out = thinking.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, seed=2, response_format=fmt,
                                           logit_bias=brace)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and msg.model_extra.get("reasoning") is None
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    # a prompt that leaves a thought open: the reply thinks first, free of the schema (a random
    # model never closes its thought, so max_tokens ends it: all reasoning, no answer yet)
    inside = {"chat_template": "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n"}
    for stream in (False, True):
        kw = dict(model=model, messages=MESSAGES, max_tokens=12, seed=3, response_format=fmt, extra_body=inside)
        if stream:
            deltas = [c.choices[0].delta for c in thinking.chat.completions.create(**kw, stream=True) if c.choices]
            reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
            assert reasoning and not "".join(d.content or "" for d in deltas)
        else:
            out = thinking.chat.completions.create(**kw)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12
            assert out.choices[0].message.content is None and out.choices[0].message.model_extra["reasoning"]
    # vLLM's thinking_token_budget: the thought is cut after its budget, </think> forced, and the
    # answer follows — the schema's, or any text without one
    for extra, check in (({"response_format": fmt}, lambda c: jsonschema.validate(json.loads(c), SCHEMA)),
                         ({}, lambda c: None)):
        out = thinking.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, seed=4, **extra,
                                               extra_body={**inside, "thinking_token_budget": 5})
        msg = out.choices[0].message
        assert msg.model_extra["reasoning"] and msg.content, (msg, out.choices[0].finish_reason)
        check(msg.content)
        assert 0 < out.usage.completion_tokens_details.reasoning_tokens < out.usage.completion_tokens


@pytest.fixture(scope="module")
def r1(mesh):
    """A third router on the same workers, with DeepSeek-R1's parser: every reply starts inside
    its thought. The Anthropic client and the openai one on it."""
    m, _, folder, ps, ds = mesh
    r = m.start_router(ps, ds, "--model", str(folder), "--request-timeout", "60", "--reasoning-parser", "deepseek_r1")
    return (anthropic.Anthropic(base_url=r.http_url, api_key="unused", max_retries=0, timeout=90),
            openai.OpenAI(base_url=r.http_url + "/v1", api_key="unused", max_retries=0, timeout=90))


def test_messages_thinking_blocks(mesh, r1, model):
    client, chat = r1
    # Anthropic's thinking budget is vLLM's thinking_token_budget: the thought is cut after 5 tokens,
    # then the answer follows (greedy, so both routes write the same)
    want = chat.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0,
                                        extra_body={"thinking_token_budget": 5}).choices[0].message
    assert want.model_extra["reasoning"] and want.content
    kw = dict(model=model, messages=MESSAGES, max_tokens=40, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 5})
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text"], msg
    assert msg.content[0].thinking == want.model_extra["reasoning"] and msg.content[1].text == want.content
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == msg.content[0].thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == msg.content[1].text
    assert [b.type for b in final.content] == ["thinking", "text"] and final.usage.output_tokens == msg.usage.output_tokens
    # display omitted: the answer alone
    quiet = client.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 5, "display": "omitted"}})
    assert [b.type for b in quiet.content] == ["text"] and quiet.content[0].text == want.content
    # the thought goes back with its turn (the chat message's reasoning_content) and the conversation goes on
    follow = client.messages.create(model=model, max_tokens=4, extra_body={"temperature": 0}, messages=[
        *MESSAGES, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": "And tomorrow?"}])
    assert follow.content and follow.usage.output_tokens == 4


def test_mesh_is_clean_afterwards(mesh):
    mesh[0].assert_invariants()
