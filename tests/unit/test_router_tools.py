"""Tools in the router: `tools`/`tool_choice` validation (OpenAI-style 400s), rendering through
the chat template, the grammar of a forced call (checked with llguidance over the model's own
tokenizer), parser selection, and the reply's `tool_calls` (JSON body and SSE deltas)."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.config import ROUTER_FLAGS, parse_args
from services.common.grammar_spec import to_llguidance
from services.common.tokenizer import load_tokenizer
from services.fakes.hf_checkpoints import save_tiny_qwen2_tools
from services.router.errors import APIError
from services.router.model_info import tool_parser
from services.router.orchestrator import Chunk
from services.router.output import TokenStrings
from services.router.protocol import ModelInfo, parse_chat
from services.router.render import ResponseState
from services.router.tools import Tool, tool_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_qwen2_tools(tmp_path_factory.mktemp("qwen-tools") / "m")


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(str(folder))


@pytest.fixture(scope="module")
def info(tok):
    return ModelInfo(name="m", tokenizer=tok, context_length=2048, tool_parser=tool_parser("auto", tok))


@pytest.fixture(scope="module")
def lltok(folder, tok):
    return llguidance.LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=tok.vocab_size,
                                  eos_token=tok.eos_token_ids)


def chat(info, **kw):
    return parse_chat({"model": "m", "messages": MSGS, "max_tokens": 64, **kw}, info)


def rejects(info, param=None, code=None, **kw):
    with pytest.raises(APIError) as e:
        chat(info, **kw)
    err = e.value
    assert err.status == 400 and err.message, err
    assert param is None or err.param == param, err
    assert code is None or err.code == code, err
    return err


# --- parser selection -----------------------------------------------------------------------------


def test_parser_is_detected_from_the_template_or_named(tok):
    assert tool_parser("auto", tok) == "hermes"
    assert tool_parser("llama3_json", tok) == "llama3_json"
    assert tool_parser("none", tok) is None
    assert tool_parser("auto", BuiltinTokenizer()) is None  # its template shows no tool format
    assert tool_parser("auto", load_tokenizer(None)) is None


def test_tool_call_parser_flag(tok, monkeypatch, capsys):
    from services.common.config import ROUTER_FLAGS, RouterSettings, parse_args

    args = parse_args("router", "", ROUTER_FLAGS, ["--decode", "h:1", "--tool-call-parser", "llama3_json"])
    assert RouterSettings.from_args(args).tool_call_parser == "llama3_json"
    assert parse_args("router", "", ROUTER_FLAGS, ["--decode", "h:1"]).tool_call_parser == "auto"
    monkeypatch.setenv("PDMESH_TOOL_CALL_PARSER", "none")
    assert parse_args("router", "", ROUTER_FLAGS, ["--decode", "h:1"]).tool_call_parser == "none"
    with pytest.raises(SystemExit):
        parse_args("router", "", ROUTER_FLAGS, ["--decode", "h:1", "--tool-call-parser", "mistral"])
    capsys.readouterr()


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,param,code", [
    (dict(tools={}), "tools", "invalid_type"),
    (dict(tools=[]), "tools", "empty_array"),
    (dict(tools=["f"]), "tools[0]", "invalid_type"),
    (dict(tools=[{"function": {"name": "f"}}]), "tools[0].type", "missing_required_parameter"),
    (dict(tools=[{"type": "custom", "function": {"name": "f"}}]), "tools[0].type", "invalid_value"),
    (dict(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter"),
    (dict(tools=[{"type": "function", "function": "f"}]), "tools[0].function", "invalid_type"),
    (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name",
     "missing_required_parameter"),
    (dict(tools=[{"type": "function", "function": {"name": 5}}]), "tools[0].function.name", "invalid_type"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "invalid_value"),
    (dict(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name", "invalid_value"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": 1}}]),
     "tools[0].function.description", "invalid_type"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters", "invalid_type"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters", "invalid_value"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict", "invalid_type"),
    (dict(tools=TOOLS + [TOOLS[1]]), "tools[2].function.name", "invalid_value"),  # duplicate name
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (dict(tools=TOOLS, tool_choice=3), "tool_choice", "invalid_type"),
    (dict(tools=TOOLS, tool_choice={"function": {"name": "ping"}}), "tool_choice.type", "missing_required_parameter"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice.function", "missing_required_parameter"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {}}), "tool_choice.function.name",
     "missing_required_parameter"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", "invalid_value"),
    (dict(tool_choice="required"), "tool_choice", "invalid_value"),  # without tools
    (dict(tool_choice={"type": "function", "function": {"name": "ping"}}), "tool_choice", "invalid_value"),
    (dict(parallel_tool_calls=False), "parallel_tool_calls", "invalid_value"),
    (dict(functions=[{"name": "f"}]), "functions", "unsupported_value"),  # the deprecated spelling
    (dict(tools=TOOLS, function_call="auto"), "function_call", "unsupported_value"),
    (dict(tools=TOOLS, parallel_tool_calls="no"), "parallel_tool_calls", "invalid_type"),
    # both constrain the whole reply
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "invalid_value"),
    (dict(tools=TOOLS, tool_choice="required", ignore_eos=True), "ignore_eos", "unsupported_value"),
    # a schema llguidance cannot enforce
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}], tool_choice="required"),
     "tools", "invalid_value"),
])
def test_bad_tool_requests(info, kw, param, code):
    rejects(info, param=param, code=code, **kw)


def test_unknown_function_names_the_known_ones(info):
    err = rejects(info, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "no function named 'nope'" in err.message and "get_weather, ping" in err.message


def test_a_model_without_tool_format_refuses_tools_unless_none():
    info = ModelInfo(name="m", tokenizer=BuiltinTokenizer(), context_length=512)
    err = rejects(info, param="tools", code="unsupported_value", tools=TOOLS)
    assert "--tool-call-parser" in err.message
    spec = chat(info, tools=TOOLS, tool_choice="none")  # rendered (the template ignores them), not parsed
    assert spec.tool_parser is None and spec.grammar is None
    assert chat(info, tool_choice="none").tool_parser is None  # none without tools is harmless


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "x", "tool_call_id": 1}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": {}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].type"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
])
def test_bad_tool_messages(info, messages, param):
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": messages, "max_tokens": 4}, info)
    assert e.value.status == 400 and e.value.param == param


# --- rendering ------------------------------------------------------------------------------------


def test_tools_and_tool_messages_go_through_the_template(info, tok, folder):
    messages = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    for choice in ("auto", "none", "required"):
        spec = parse_chat({"model": "m", "messages": messages, "tools": TOOLS, "tool_choice": choice,
                           "max_tokens": 8}, info)
        # transformers renders the same conversation (arguments as an object, as it documents) to the same ids
        from transformers import AutoTokenizer
        reference = AutoTokenizer.from_pretrained(str(folder))
        ref_messages = [messages[0], {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            messages[2]]
        text = reference.apply_chat_template(ref_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert spec.prompt_ids == tok.encode(text, add_special_tokens=False)
        assert '"arguments": {"city": "Paris"}' in text and "<tool_response>\nsunny\n</tool_response>" in text
        assert spec.tool_parser == (None if choice == "none" else "hermes")
        assert (spec.grammar is not None) == (choice == "required")


# --- the grammar ----------------------------------------------------------------------------------


def matcher(lltok, grammar):
    kind, source = grammar
    m = llguidance.LLMatcher(lltok, to_llguidance(kind, source), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(lltok, tok, grammar, text) -> bool:
    m = matcher(lltok, grammar)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def hermes_call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_named_function_grammar_forces_that_function(info, tok, lltok):
    spec = chat(info, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert spec.grammar[0] == "lark" and spec.tool_parser == "hermes"
    assert "<[" in spec.grammar[1]  # <tool_call> is one token of this tokenizer: referenced as a token
    assert accepts(lltok, tok, spec.grammar, hermes_call("get_weather", {"city": "Paris", "days": 3}))
    assert not accepts(lltok, tok, spec.grammar, hermes_call("get_weather", {"city": "Rome"}))  # not in the enum
    assert not accepts(lltok, tok, spec.grammar, hermes_call("get_weather", {"days": 3}))  # city is required
    assert not accepts(lltok, tok, spec.grammar, hermes_call("ping", {}))
    assert not accepts(lltok, tok, spec.grammar, "Sure! " + hermes_call("get_weather", {"city": "Paris"}))
    # one call only, even with parallel calls allowed
    two = hermes_call("get_weather", {"city": "Paris"}) + "\n" + hermes_call("get_weather", {"city": "Lima"})
    assert not accepts(lltok, tok, spec.grammar, two)


def test_required_grammar_allows_any_tool_and_parallel_calls(info, tok, lltok):
    spec = chat(info, tools=TOOLS, tool_choice="required")
    one = hermes_call("ping", {})
    two = hermes_call("get_weather", {"city": "Lima"}) + "\n" + hermes_call("ping", {})
    assert accepts(lltok, tok, spec.grammar, one) and accepts(lltok, tok, spec.grammar, two)
    assert not accepts(lltok, tok, spec.grammar, hermes_call("ping", {"x": 1}))  # no parameters: {}
    assert not accepts(lltok, tok, spec.grammar, "no call")
    single = chat(info, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert accepts(lltok, tok, single.grammar, one) and not accepts(lltok, tok, single.grammar, two)
    # the reply, once accepted, parses back into the calls
    from services.router.tool_parsers import FORMATS
    parsed = FORMATS["hermes"].parse(two)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Lima"}),
                                                                         ("ping", {})]


def test_auto_has_no_grammar(info):
    spec = chat(info, tools=TOOLS)
    assert spec.grammar is None and spec.tool_parser == "hermes"


def test_llama3_json_grammar_compiles_and_matches(tok, lltok):
    grammar = ("lark", tool_grammar("llama3_json", [Tool("get_weather", WEATHER)], parallel=True))
    good = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert accepts(lltok, tok, grammar, good) and accepts(lltok, tok, grammar, good + "; " + good)
    assert not accepts(lltok, tok, grammar, '{"name": "get_weather", "parameters": {}}')


# --- the reply --------------------------------------------------------------------------------------


def feed_all(state: ResponseState, tok, text: str, finish="stop", pieces=4, sse=False):
    """Feed `text`'s tokens in chunks (eos last when it ends with "stop"); with sse, the chunks' payloads."""
    ids = tok.encode(text, add_special_tokens=False)
    payloads = []
    step = max(1, len(ids) // pieces)
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        chunk_ids = ids[i : i + step] + ([tok.eos_token_ids[0]] if last and finish == "stop" else [])
        content, entries = state.feed(Chunk(chunk_ids, [], finish if last else ""))
        if sse and (p := state.delta_chunk(content, entries, state.finish_reason)) is not None:
            payloads.append(p["choices"][0])
    return payloads


def test_json_body_has_tool_calls(info, tok):
    spec = chat(info, tools=TOOLS, n=2)
    text = "Checking.\n" + hermes_call("get_weather", {"city": "Paris"})
    states = [ResponseState(spec, tok, TokenStrings(tok), "r", index=i) for i in range(2)]
    feed_all(states[0], tok, text)
    feed_all(states[1], tok, "No tools needed.")
    body = states[0].body(states)
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Checking."
    call = first["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert second["finish_reason"] == "stop" and second["message"]["content"] == "No tools needed."
    assert "tool_calls" not in second["message"]


@pytest.mark.parametrize("choice, finish", [
    ("auto", "tool_calls"), ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_finish_reason_of_a_call_follows_openai_per_tool_choice(info, tok, choice, finish, stream):
    """OpenAI (and vLLM) finish a reply that made calls with "tool_calls" under auto and required,
    and with "stop" when tool_choice named the function; both ways, streamed or not."""
    spec = chat(info, tools=TOOLS, tool_choice=choice, stream=stream)
    state = ResponseState(spec, tok, TokenStrings(tok), "r")
    payloads = feed_all(state, tok, hermes_call("get_weather", {"city": "Paris"}), sse=stream)
    got = payloads[-1]["finish_reason"] if stream else state.body()["choices"][0]["finish_reason"]
    assert got == finish
    if not stream:
        assert state.body()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_cut_call_keeps_length_and_stays_content(info, tok):
    spec = chat(info, tools=TOOLS)
    state = ResponseState(spec, tok, TokenStrings(tok), "r")
    text = hermes_call("get_weather", {"city": "Paris"})[:30]
    feed_all(state, tok, text, finish="length")
    choice = state.body()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == text
    assert "tool_calls" not in choice["message"]


def test_tool_choice_none_is_never_parsed(info, tok):
    spec = chat(info, tools=TOOLS, tool_choice="none")
    state = ResponseState(spec, tok, TokenStrings(tok), "r")
    text = hermes_call("ping", {})
    feed_all(state, tok, text)
    choice = state.body()["choices"][0]
    assert choice["message"]["content"] == text and choice["finish_reason"] == "stop"


def test_sse_deltas(info, tok):
    spec = chat(info, tools=TOOLS, stream=True)
    state = ResponseState(spec, tok, TokenStrings(tok), "r")
    text = "Hi " + hermes_call("get_weather", {"city": "Paris", "days": 2})
    payloads = feed_all(state, tok, text, pieces=12, sse=True)
    content = "".join(p["delta"].get("content") or "" for p in payloads)
    calls = [tc for p in payloads for tc in p["delta"].get("tool_calls", [])]
    assert content == "Hi"
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 for c in calls) and all("id" not in c for c in calls[1:])
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris", "days": 2}
    assert payloads[-1]["finish_reason"] == "tool_calls"
    assert all(p["finish_reason"] is None for p in payloads[:-1])


# --- a Llama 3.1-style template: llama3_json ------------------------------------------------------

# Written for this test in the manner of Llama 3.1's JSON tool calling: tools in the first user
# turn, calls as {"name", "parameters"}, results in an "ipython" turn.
LLAMA31_TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a '"
    " + 'function call. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name '"
    " + 'and its value}.\\n\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set fn = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + fn.name + '\", \"parameters\": ' }}"
    "{{- fn.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    from tests.unit.test_tokenizer import build_llama3_folder

    folder = build_llama3_folder(tmp_path_factory.mktemp("llama31") / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA31_TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_llama31_template_end_to_end_in_the_router(llama_folder):
    tok = load_tokenizer(str(llama_folder))
    assert tool_parser("auto", tok) == "llama3_json"
    info = ModelInfo(name="m", tokenizer=tok, context_length=4096, tool_parser="llama3_json")
    messages = [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "cloudy"}]
    spec = parse_chat({"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64,
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, info)
    text = tok.decode(spec.prompt_ids, skip_special_tokens=False)
    assert '{"name": "get_weather", "parameters": {"city": "Lima"}}' in text and "ipython" in text
    lltok = llguidance.LLTokenizer((llama_folder / "tokenizer.json").read_text(), n_vocab=tok.vocab_size,
                                   eos_token=tok.eos_token_ids)
    reply = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}'
    assert accepts(lltok, tok, spec.grammar, reply)
    assert not accepts(lltok, tok, spec.grammar, '{"name": "ping", "parameters": {}}')
    state = ResponseState(spec, tok, TokenStrings(tok), "r")
    feed_all(state, tok, reply)
    choice = state.body()["choices"][0]
    # a call forced by name finishes "stop", as OpenAI and vLLM answer it
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "days": 1}'}


def test_auto_tool_choice_can_be_turned_off(tok):
    # vLLM's --enable-auto-tool-choice (on here by default); off, auto — also the default choice
    # when tools are given — is a 400, and the other choices still work
    off = ModelInfo(name="m", tokenizer=tok, context_length=2048, tool_parser=tool_parser("auto", tok),
                    auto_tool_choice=False)
    for kw in ({}, {"tool_choice": "auto"}):
        err = rejects(off, param="tool_choice", code="unsupported_value", tools=TOOLS, **kw)
        assert "--no-enable-auto-tool-choice" in err.message
    assert chat(off, tools=TOOLS, tool_choice="required").grammar is not None
    assert chat(off, tools=TOOLS, tool_choice="none").tool_parser is None
    assert chat(off, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}).tool_named
    args = parse_args("router", "test", ROUTER_FLAGS, ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.enable_auto_tool_choice is True
    assert parse_args("router", "test", ROUTER_FLAGS, ["--no-enable-auto-tool-choice"]).enable_auto_tool_choice is False
