"""Tool-call parsers (services/router/tool_parsers.py): whole replies and streams, per format.

A stream, assembled the way the openai SDK assembles deltas (by index, strings joined), must give
the same content and calls as the whole reply, however the text is cut into deltas."""

from __future__ import annotations

import json
import random

import pytest

from services.common.tokenizer import BUILTIN_MODEL_DIR
from services.fakes.hf_checkpoints import QWEN_TOOLS_TEMPLATE
from services.router.tool_parsers import FORMATS, PYTHON_TAG, ToolStream, detect_tool_parser

HERMES = FORMATS["hermes"]
LLAMA = FORMATS["llama3_json"]


def call(name: str, args: dict | str) -> str:
    text = args if isinstance(args, str) else json.dumps(args)
    return "<tool_call>\n" + json.dumps({"name": name})[:-1] + ', "arguments": ' + text + "}\n</tool_call>"


def assemble(stream: ToolStream, pieces: list[str]) -> tuple[str, list[dict], list[list[dict]]]:
    """Content, calls (id, name, arguments) and every call's deltas, as a client sees them."""
    content, calls, per_call = "", {}, {}

    def take(out):
        nonlocal content
        text, deltas = out
        content += text
        for d in deltas:
            per_call.setdefault(d["index"], []).append(d)
            entry = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in d:
                assert entry["id"] is None, "a call announced twice"
                entry["id"] = d["id"]
            fn = d.get("function", {})
            entry["name"] += fn.get("name") or ""
            entry["arguments"] += fn.get("arguments") or ""

    for piece in pieces:
        take(stream.feed(piece))
    take(stream.finish())
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[k] for k in sorted(calls)], [per_call[k] for k in sorted(per_call)]


def cuts(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 9)
        pieces.append(text[i : i + k])
        i += k
    return pieces


def assert_parses_as(fmt, text: str, content, calls):
    """The whole reply parses into this content and these (name, arguments) calls."""
    parsed = fmt.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    return parsed


def check_stream_equals_whole(fmt, text: str, seeds: int = 12) -> None:
    whole = fmt.parse(text)
    chunkings = [[text], list(text)] + [cuts(text, random.Random(s)) for s in range(seeds)]
    for pieces in chunkings:
        content, calls, per_call = assemble(fmt.stream(), pieces)
        assert (content or None) == (whole.content or None) if whole.calls else content == whole.content, pieces
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls], pieces
        for deltas in per_call:  # the SDK's shape: id, type and name first, then argument fragments
            first = deltas[0]
            assert first["id"].startswith("call_") and first["type"] == "function" and first["function"]["name"]
            assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])


# --- hermes -----------------------------------------------------------------------------------

WEATHER = {"city": "Paris", "unit": "celsius"}
HERMES_CASES = [
    # (text, content, [(name, arguments)])
    (call("get_weather", WEATHER), None, [("get_weather", json.dumps(WEATHER))]),
    ("Let me look.\n" + call("get_weather", WEATHER), "Let me look.", [("get_weather", json.dumps(WEATHER))]),
    (call("a", {"x": 1}) + "\n" + call("b", {}) + "\n", None, [("a", '{"x": 1}'), ("b", "{}")]),
    ("Sure. " + call("a", {"x": [1, {"y": "z"}]}) + "\nDone!", "Sure.Done!", [("a", '{"x": [1, {"y": "z"}]}')]),
    # a closing marker inside an argument string does not end the call
    (call("echo", {"text": "say </tool_call> and }"}), None, [("echo", '{"text": "say </tool_call> and }"}')]),
    # escapes and unicode in strings, keys in either order, arguments as a JSON string
    ('<tool_call>\n{"arguments": {"q": "caf\\u00e9 \\"x\\""}, "name": "s"}\n</tool_call>', None,
     [("s", '{"q": "caf\\u00e9 \\"x\\""}')]),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', None, [("s", '{"q": 1}')]),
    ('<tool_call>\n{"name": "noargs"}\n</tool_call>', None, [("noargs", "{}")]),
    # the end marker cut off by a stop string or the token limit: the call is still whole
    ("x " + '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "x", [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool', None, [("f", '{"a": 1}')]),
    # no calls
    ("Just text, no calls.", "Just text, no calls.", []),
    ("a < b and <tool is not a marker", "a < b and <tool is not a marker", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole(text, content, calls):
    parsed = assert_parses_as(HERMES, text, content, calls)
    for c in parsed.calls:
        assert isinstance(json.loads(c.arguments), dict)
        assert c.to_openai()["type"] == "function" and c.id.startswith("call_")


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_stream_equals_whole(text, content, calls):
    check_stream_equals_whole(HERMES, text)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',  # bad JSON inside the arguments
    '<tool_call>\n{"name": f, "arguments": {}}\n</tool_call>',  # bad JSON in the name
    '<tool_call>\n{"name": "f", "arguments": {}, "extra": 1}\n</tool_call>',  # not the format's keys
    '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',  # duplicate key
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # name not a string
    '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"arguments": [1, 2], "name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>',
    '<tool_call>\n["f", {}]\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>',
    'Before <tool_call>\n{"name": "f", "arguments": {"a": 1',  # unterminated: the token limit
])
def test_hermes_malformed_is_content(text):
    parsed = HERMES.parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_malformed_call_next_to_a_good_one():
    bad = '<tool_call>\n{"name": 3}\n</tool_call>'
    text = bad + "\n" + call("ok", {"a": 1})
    parsed = HERMES.parse(text)
    assert parsed.content == bad and [(c.name, c.arguments) for c in parsed.calls] == [("ok", '{"a": 1}')]
    check_stream_equals_whole(HERMES, text)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call> after',  # malformed before the name is known
    '<tool_call>\n["f"]\n</tool_call>',
    '<tool_call>\n{"extra": 1, "name": "f"}\n</tool_call>',
    '<tool_call>\n{"arguments": [1], "name": "f"}\n</tool_call>',
])
def test_hermes_stream_gives_back_unannounced_malformed_calls(text):
    for pieces in ([text], list(text), cuts(text, random.Random(1))):
        content, calls, _ = assemble(HERMES.stream(), pieces)
        assert content == text and calls == []


def test_hermes_stream_announced_then_malformed_keeps_what_was_sent():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>\nafter'
    content, calls, _ = assemble(HERMES.stream(), list(text))
    assert [c["name"] for c in calls] == ["f"] and content == "after"


def test_hermes_stream_holds_back_only_a_possible_marker():
    s = HERMES.stream()
    assert s.feed("Hello world") == ("Hello world", [])
    assert s.feed(" and <tool") == (" and", [])  # a possible marker and the blanks before it wait
    text, deltas = s.feed("s>")
    assert text == " <tools>" and deltas == []
    assert s.feed("\n<tool_call>\n{\"name\": \"f") == ("", [])
    text, deltas = s.feed('", ')  # the name is known: the call is announced
    assert text == "" and deltas[0]["function"] == {"name": "f", "arguments": ""} and len(deltas) == 1
    text, deltas = s.feed('"arguments": {"a"')
    assert deltas == [{"index": 0, "function": {"arguments": '{"a"'}}]
    assert s.feed(": 1}}\n</tool_call>") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert s.finish() == ("", []) and s.has_calls


def test_hermes_stream_streams_argument_fragments_as_they_come():
    text = call("f", {"long": "x" * 50, "n": 1})
    _, calls, per_call = assemble(HERMES.stream(), cuts(text, random.Random(5)))
    assert len(per_call[0]) > 5  # many fragments, not one at the end
    assert json.loads(calls[0]["arguments"]) == {"long": "x" * 50, "n": 1}


def test_many_calls_index_in_order():
    text = "\n".join(call(f"f{i}", {"i": i}) for i in range(6))
    _, calls, per_call = assemble(HERMES.stream(), cuts(text, random.Random(2)))
    assert [c["name"] for c in calls] == [f"f{i}" for i in range(6)]
    assert [json.loads(c["arguments"]) for c in calls] == [{"i": i} for i in range(6)]
    assert len({c["id"] for c in calls}) == 6


def test_random_hermes_replies_stream_equals_whole():
    rng = random.Random(7)
    for _ in range(60):
        parts = []
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.5:
                parts.append(rng.choice(["Hi.", " text ", "\n", "a<b", "<tool", "}", "ok\n\n"]))
            args = {"k": rng.choice(["v", "</tool_call>", "{[", 'q"uote', "é"]), "n": rng.randint(0, 99)}
            parts.append(call(rng.choice(["a", "b_c", "d-e"]), args))
        if rng.random() < 0.5:
            parts.append(rng.choice([" tail", "\n", "<tool_call>\n{\"name\": 1}"]))
        check_stream_equals_whole(HERMES, "".join(parts), seeds=4)


# --- llama3_json --------------------------------------------------------------------------------

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    (PYTHON_TAG + '{"name": "f", "parameters": {"a": [1, 2]}}', None, [("f", '{"a": [1, 2]}')]),
    ('  {"name": "f", "arguments": {}} ; {"name": "g", "parameters": {"b": "}"}};', None,
     [("f", "{}"), ("g", '{"b": "}"}')]),
    ('{"name": "f"}', None, [("f", "{}")]),
    ("The answer is 42.", "The answer is 42.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "f", "parameters": {"a": 1}} and then text', '{"name": "f", "parameters": {"a": 1}} and then text', []),
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),  # cut short: content whole
    ("", "", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_whole(text, content, calls):
    assert_parses_as(LLAMA, text, content, calls)


@pytest.mark.parametrize("text,content,calls", [c for c in LLAMA_CASES if "cut short" not in c[0] and
                                                "and then" not in c[0] and not c[0].endswith('"a": ')])
def test_llama3_json_stream_equals_whole(text, content, calls):
    check_stream_equals_whole(LLAMA, text)


def test_llama3_json_stream_plain_text_is_released_at_once():
    s = LLAMA.stream()
    assert s.feed("  ") == ("", [])  # undecided
    assert s.feed("Hello") == ("  Hello", [])
    assert s.feed(" there {") == (" there {", [])
    assert s.finish() == ("", []) and not s.has_calls


def test_llama3_json_stream_json_that_is_no_call_becomes_content():
    text = '{"answer": {"value": 42}}'
    content, calls, _ = assemble(LLAMA.stream(), list(text))
    assert content == text and calls == []


# --- detection --------------------------------------------------------------------------------

LLAMA31_SNIPPET = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}Given the following functions, please respond "
    "with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}"
)


def test_detect_tool_parser():
    assert detect_tool_parser([QWEN_TOOLS_TEMPLATE]) == "hermes"
    assert detect_tool_parser([LLAMA31_SNIPPET]) == "llama3_json"
    assert detect_tool_parser([None, QWEN_TOOLS_TEMPLATE]) == "hermes"
    builtin = (BUILTIN_MODEL_DIR / "chat_template.jinja").read_text()
    assert detect_tool_parser([builtin]) is None
    assert detect_tool_parser([None, ""]) is None
