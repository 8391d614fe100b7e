"""--reasoning-parser: a reply's <think>...</think> told apart from its answer — the split itself
(fed whole and in every cut), where a reply starts for each parser, and the chat reply's body and
SSE deltas built by ResponseState (reasoning, reasoning_content, content, tool calls after the
thinking, include_reasoning false), a request's grammar after a free thought (checked with
llguidance over real tokenizers), and the Responses API's reasoning items."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import llguidance
import pytest
import tokenizers

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.config import ROUTER_FLAGS
from services.common.grammar_spec import build_tokenizer, to_llguidance, validate
from services.common.tokenizer import load_tokenizer, resolve_model_path
from services.router import responses_output
from services.router.errors import APIError
from services.router.orchestrator import Chunk
from services.router.output import TokenStrings
from services.router.protocol import ModelInfo, parse_chat
from services.router.reasoning import (
    FLAG_CHOICES,
    INSIDE,
    MAY_OPEN,
    OFF,
    ReasoningSplit,
    parser_name,
    think_first,
    thinking_mode,
)
from services.router.render import ResponseState
from services.router.responses_request import translate
from services.router.responses_stream import EventStream
from tests.unit.test_router_app import cluster_factory, sse_payloads  # noqa: F401 - fixture

CASES = [
    # (text, starts inside, reasoning, content)
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, "\nweigh it\n", "\n\nThe answer."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Just an answer.", False, None, "Just an answer."),
    ("An answer with <think> inside </think> it.", False, None, "An answer with <think> inside </think> it."),
    ("<think>cut off mid-thought", False, "cut off mid-thought", None),
    ("<think>only thinking</think>", False, "only thinking", None),
    ("thinking, no tag</think>answer", True, "thinking, no tag", "answer"),
    ("<think>tag again</think>answer", True, "tag again", "answer"),
    ("never stopped thinking", True, "never stopped thinking", None),
    ("a < b and </thin is not a tag</think>ok", True, "a < b and </thin is not a tag", "ok"),
    ("", True, "", None),
    ("", False, None, ""),
    ("<thi", False, None, "<thi"),
    ("</thi", True, "</thi", None),
]


def split_whole(text: str, inside: bool) -> tuple[str | None, str | None]:
    split = ReasoningSplit(inside)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    return split.reply(r1 + r2, c1 + c2)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_whole_replies_split(text, inside, reasoning, content):
    assert split_whole(text, inside) == (reasoning, content)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_every_two_and_three_way_cut_splits_as_the_whole(text, inside, reasoning, content):
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts:
        split = ReasoningSplit(inside)
        parts = [split.feed(p) for p in (text[:i], text[i:j], text[j:])] + [split.finish()]
        got_r = "".join(r for r, _ in parts)
        got_c = "".join(c for _, c in parts)
        assert got_r == (reasoning or ""), (i, j)
        assert got_c == (content or ""), (i, j)


def test_where_a_reply_starts():
    assert thinking_mode("deepseek_r1", "<|Assistant|>") == INSIDE
    assert thinking_mode("qwen3", "<|im_start|>assistant\n<think>\n") == INSIDE
    # Qwen3 with enable_thinking false: an empty thought closed at the prompt's end
    assert thinking_mode("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") == OFF
    assert thinking_mode("qwen3", "<|im_start|>assistant\n") == MAY_OPEN
    # an earlier turn's closed thought is not the end of the prompt
    assert thinking_mode("qwen3", "</think>ok<|im_end|>\n<|im_start|>assistant\n") == MAY_OPEN
    # DeepSeek-V3.1: its template opens a thought with `thinking`, closes one without
    assert thinking_mode("deepseek_v3", "<｜Assistant｜><think>") == INSIDE
    assert thinking_mode("deepseek_v3", "<｜Assistant｜></think>") == OFF
    assert thinking_mode("glm45", "<|assistant|>\n<think></think>\n") == OFF
    assert thinking_mode("glm45", "<|assistant|>") == MAY_OPEN


def test_a_template_switch_decides_the_thinking():
    # DeepSeek-V3.1's way: chat_template_kwargs.thinking opens or closes the thought in the prompt
    template = "{{ messages[0].content }}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}"
    on = spec("deepseek_v3", chat_template=template, chat_template_kwargs={"thinking": True})
    off = spec("deepseek_v3", chat_template=template, chat_template_kwargs={"thinking": False})
    assert on.reasoning_inside and not off.reasoning_inside
    assert body_of(on, "hmm</think>Yes.")["choices"][0]["message"]["reasoning"] == "hmm"
    assert body_of(off, "Yes.")["choices"][0]["message"]["reasoning"] is None


def test_flag_values():
    assert parser_name("") is None
    assert parser_name("deepseek-r1") == "deepseek_r1"
    assert parser_name("qwen3") == "qwen3"
    assert parser_name("deepseek-v3") == "deepseek_v3" and parser_name("glm45") == "glm45"
    with pytest.raises(ValueError):
        parser_name("granite")
    flag = next(f for f in ROUTER_FLAGS if f.name == "reasoning-parser")
    assert set(flag.choices) == set(FLAG_CHOICES)


# --- the chat reply -------------------------------------------------------------------------------

TOK = BuiltinTokenizer()
STRINGS = TokenStrings(TOK)


def info(parser: str | None) -> ModelInfo:
    return ModelInfo(name="m", tokenizer=TOK, context_length=2048, reasoning_parser=parser)


def spec(parser: str | None = "qwen3", **kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, **kw}
    return parse_chat(body, info(parser))


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def body_of(s, text: str) -> dict:
    state = ResponseState(s, TOK, STRINGS, "r1")
    state.feed(Chunk(ids(text), [], "length"))
    return state.body()


def stream_of(s, text: str, per_chunk: int = 1) -> list[dict]:
    """Every delta of the stream, decode's tokens coming per_chunk at a time."""
    state = ResponseState(s, TOK, STRINGS, "r1")
    tokens, out = ids(text), []
    for i in range(0, len(tokens), per_chunk):
        part = tokens[i : i + per_chunk]
        last = i + per_chunk >= len(tokens)
        for step in state.feed_each(Chunk(part, [], "length" if last else "")):
            payload = state.delta_chunk(*step)
            if payload is not None:
                out.append(payload["choices"][0]["delta"])
    return out


REPLY = "<think>Two and two.</think>Four."


def test_body_carries_reasoning_under_both_names():
    message = body_of(spec(), REPLY)["choices"][0]["message"]
    assert message["content"] == "Four."
    assert message["reasoning"] == message["reasoning_content"] == "Two and two."


def test_no_parser_leaves_the_reply_whole():
    message = body_of(spec(None), REPLY)["choices"][0]["message"]
    assert message["content"] == REPLY
    assert "reasoning" not in message and "reasoning_content" not in message


def test_include_reasoning_false_leaves_it_out():
    message = body_of(spec(include_reasoning=False), REPLY)["choices"][0]["message"]
    assert message["content"] == "Four."
    assert message["reasoning"] is None and message["reasoning_content"] is None
    deltas = stream_of(spec(include_reasoning=False, stream=True), REPLY)
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Four."


def test_include_reasoning_false_needs_a_parser():
    with pytest.raises(APIError) as e:
        spec(None, include_reasoning=False)
    assert e.value.status == 400 and e.value.param == "include_reasoning"
    with pytest.raises(APIError):
        spec(include_reasoning="no")


@pytest.mark.parametrize("per_chunk", [1, 3, 100])
def test_stream_deltas_add_up_to_the_body(per_chunk):
    deltas = stream_of(spec(stream=True), REPLY, per_chunk)
    assert "".join(d.get("reasoning", "") for d in deltas) == "Two and two."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two."
    assert "".join(d.get("content", "") for d in deltas) == "Four."
    # the thinking comes first, never mixed into content, and no tag reaches the client
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning") for d in deltas[first_content + 1 :])
    assert all("<" not in d.get("content", "") + d.get("reasoning", "") for d in deltas)


def test_deepseek_r1_reply_that_never_closes_is_reasoning():
    message = body_of(spec("deepseek_r1"), "thinking until the end")["choices"][0]["message"]
    assert message["reasoning"] == "thinking until the end" and message["content"] is None


def test_a_grammar_holds_after_the_thinking():
    s = spec("deepseek_r1", response_format={"type": "json_object"})
    assert s.reasoning_inside and s.grammar[0] == "llguidance" and s.grammar_param == "response_format"
    message = body_of(s, 'weigh it</think>\n{"a": 1}')["choices"][0]["message"]
    assert message["reasoning"] == "weigh it" and message["content"] == '\n{"a": 1}'
    # thinking turned off in the prompt: the request's grammar as it came
    off = spec("qwen3", response_format={"type": "json_object"}, chat_template="{{ messages[0].content }}<think></think>")
    assert off.grammar[0] == "json_schema" and not off.reasoning_inside
    assert spec(None, response_format={"type": "json_object"}).grammar[0] == "json_schema"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _matcher(tok, folder, grammar):
    lltok = build_tokenizer(tok, folder, tok.vocab_size)
    return lambda: llguidance.LLMatcher(lltok, to_llguidance(*grammar), log_level=0)


def _takes(make, ids) -> tuple[bool, bool]:
    """(every token allowed, the grammar complete) after feeding `ids`."""
    m = make()
    return m.consume_tokens(ids), m.is_accepting()


@pytest.mark.parametrize("mode", [INSIDE, MAY_OPEN])
def test_thinking_grammar_with_tags_as_text(mode):
    folder = Path(resolve_model_path("builtin"))
    tok = load_tokenizer("builtin")
    grammar = think_first(("json_schema", json.dumps(SCHEMA)), mode, tok)
    assert validate(*grammar) is None
    make = _matcher(tok, folder, grammar)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    opened = "<think>" if mode == MAY_OPEN else ""
    assert _takes(make, enc(opened + "any text, even {\"a\": \"x\"}, until the tag</think>\n\n{\"a\":7}")) == (True, True)
    assert _takes(make, enc(opened + "thought</think>{\"a\":\"x\"}"))[0] is False  # the schema holds after it
    assert _takes(make, enc(opened + "still thinking {\"a\":7}")) == (True, False)  # not done without </think>
    # without a thought: the answer itself (MAY_OPEN), or still the thought (INSIDE)
    assert _takes(make, enc("{\"a\":7}")) == (True, mode == MAY_OPEN)


def test_thinking_grammar_with_tags_as_tokens(tmp_path):
    # a tokenizer that has <think> and </think> as tokens of their own (Qwen3, R1 distills): the
    # grammar names them by id, as free text can never write them
    folder, tok = _tags_as_tokens(tmp_path)
    open_id, close_id = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert len(open_id) == len(close_id) == 1
    grammar = think_first(("json_schema", json.dumps(SCHEMA)), INSIDE, tok)
    lark = json.loads(grammar[1])["grammars"][0]["lark_grammar"]
    assert f"<[{close_id[0]}]>" in lark and f"<[{open_id[0]}]>" in lark
    make = _matcher(tok, folder, grammar)
    text = tok.encode("a thought", add_special_tokens=False)
    answer = tok.encode('{"a":1}', add_special_tokens=False)
    assert _takes(make, [*open_id, *text, *close_id, *answer]) == (True, True)
    assert _takes(make, [*text, *close_id, *answer]) == (True, True)
    assert _takes(make, [*text, *answer]) == (True, False)  # no </think> yet: all of it is the thought


def _tags_as_tokens(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(resolve_model_path("builtin"), folder)
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_tokens(["<think>", "</think>"])
    hf.save(str(folder / "tokenizer.json"))
    return folder, load_tokenizer(str(folder))


@pytest.mark.parametrize("tags", ["text", "tokens"])
def test_a_thinking_budget_forces_the_thought_to_end(tmp_path, tags):
    # vLLM's thinking_token_budget: after that many tokens of thought, </think> is forced; a request
    # without a grammar may then answer anything
    if tags == "text":
        folder, tok = Path(resolve_model_path("builtin")), load_tokenizer("builtin")
    else:
        folder, tok = _tags_as_tokens(tmp_path)
    close = tok.encode("</think>", add_special_tokens=False)
    words = tok.encode(" one two three four five six seven eight nine ten eleven twelve", add_special_tokens=False)
    # a tag written as text counts its own tokens in the budget, so that one begun within it ends
    limit = 4 + (len(close) if tags == "text" else 0)
    for grammar, answer in ((None, "free text, any"), (("json_schema", json.dumps(SCHEMA)), '{"a":3}')):
        make = _matcher(tok, folder, think_first(grammar, INSIDE, tok, budget=4))
        m = make()
        assert m.consume_tokens(words[:limit])
        forced = tok.decode(m.compute_ff_tokens(), skip_special_tokens=False)
        # the budget is spent: the tag comes next (its last token may still join what follows)
        assert forced.startswith("</think"), forced
        assert _takes(make, [*words[:limit], *close, *tok.encode(answer, add_special_tokens=False)]) == (True, True)
        assert _takes(make, words[: limit + 1])[0] is False  # one more token of thought is refused
        # a thought that ends by itself within the budget
        assert _takes(make, [*words[:2], *close, *tok.encode(answer, add_special_tokens=False)]) == (True, True)
    # a budget of 0: no thought at all (a leading <think> is still the model's to write)
    make = _matcher(tok, folder, think_first(None, INSIDE, tok, budget=0))
    opened = tok.encode("<think>", add_special_tokens=False)
    assert _takes(make, [*close, *words]) == (True, True)
    assert _takes(make, [*opened, *close, *words]) == (True, True)
    assert _takes(make, words[:1])[0] is False


def test_thinking_token_budget_in_requests():
    s = spec("deepseek_r1", thinking_token_budget=8)
    assert s.grammar[0] == "llguidance" and s.grammar_param == "thinking_token_budget"
    assert spec("deepseek_r1", thinking_token_budget=-1).grammar is None  # vLLM's "no budget"
    with_schema = spec("deepseek_r1", thinking_token_budget=8, response_format={"type": "json_object"})
    assert with_schema.grammar[0] == "llguidance" and with_schema.grammar_param == "response_format"
    # thinking turned off in the prompt: nothing to bound
    off = spec("qwen3", thinking_token_budget=8, chat_template="{{ messages[0].content }}<think></think>")
    assert off.grammar is None
    for bad in (-2, 1.5, "8"):
        with pytest.raises(APIError) as e:
            spec("qwen3", thinking_token_budget=bad)
        assert e.value.param == "thinking_token_budget"
    with pytest.raises(APIError) as e:  # without a parser there is no thinking to bound
        spec(None, thinking_token_budget=8)
    assert e.value.param == "thinking_token_budget"


def test_prompt_left_open_starts_inside():
    # an assistant turn continued mid-thought
    s = spec(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>so far"}],
             add_generation_prompt=False, continue_final_message=True)
    assert s.reasoning_inside
    assert body_of(s, " more</think>done")["choices"][0]["message"]["content"] == "done"


def test_tool_calls_are_looked_for_after_the_thinking():
    s = spec()
    s.tool_parser = "hermes"  # as a request with tools on a Hermes-format template sets it
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    state = ResponseState(s, TOK, STRINGS, "r1")
    state.feed(Chunk(ids("<think>I should call f.</think>" + call), [], "length"))
    choice = state.body()["choices"][0]
    assert choice["message"]["reasoning"] == "I should call f."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"x": 1}


# --- the Responses API ----------------------------------------------------------------------------


def test_responses_body_has_a_reasoning_item_first():
    chat = body_of(spec(), REPLY)
    resp = responses_output.from_chat(chat, {})
    assert [i["type"] for i in resp["output"]] == ["reasoning", "message"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two and two."}]
    assert resp["output"][0]["id"].startswith("rs_")
    assert resp["output"][1]["content"][0]["text"] == "Four."
    # cut while thinking: the reasoning alone, incomplete, as OpenAI answers it
    cut = responses_output.from_chat(body_of(spec(), "<think>still going"), {})
    assert [(i["type"], i["status"]) for i in cut["output"]] == [("reasoning", "incomplete")]
    plain = responses_output.from_chat(body_of(spec(None), REPLY), {})
    assert [i["type"] for i in plain["output"]] == ["message"]


def test_responses_stream_has_reasoning_events_then_text():
    state = ResponseState(spec(stream=True), TOK, STRINGS, "r1")
    stream = EventStream({})
    events = []
    for step in state.feed_each(Chunk(ids(REPLY), [], "length")):
        payload = state.delta_chunk(*step)
        if payload is not None:
            events += stream.feed(payload)
    events += stream.finish()
    parsed = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    kinds = [p["type"] for p in parsed]
    reasoning = "".join(p["delta"] for p in parsed if p["type"] == "response.reasoning_text.delta")
    text = "".join(p["delta"] for p in parsed if p["type"] == "response.output_text.delta")
    assert reasoning == "Two and two." and text == "Four."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = parsed[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "Two and two."


def test_a_reasoning_item_given_back_joins_its_message():
    req = translate({"model": "m", "input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"role": "user", "content": "and 3+3?"},
    ]})
    assert req.chat["messages"] == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "and 3+3?"},
    ]
    with pytest.raises(APIError) as e:  # another provider's: nothing here can read it
        translate({"model": "m", "input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]})
    assert e.value.param == "input[0].encrypted_content"


def test_encrypted_reasoning_asked_for_comes_back_and_is_read_back():
    # include ["reasoning.encrypted_content"] with store false (Codex's way): the reasoning item
    # carries an opaque copy of the thought, which a later turn sends back without its content
    req = translate({"model": "m", "input": "2+2?", "store": False, "include": ["reasoning.encrypted_content"]})
    assert req.opaque_reasoning
    chat = {"id": "chatcmpl-x", "created": 1, "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "4", "reasoning": "add them"}}], "usage": None}
    item = responses_output.from_chat(chat, req.echo, opaque=True)["output"][0]
    assert item["type"] == "reasoning" and item["encrypted_content"].startswith("pdmesh.r1.")
    assert responses_output.from_chat(chat, req.echo)["output"][0]["encrypted_content"] is None  # not asked
    back = translate({"model": "m", "input": [
        {"role": "user", "content": "2+2?"},
        {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"role": "user", "content": "and 3+3?"}]})
    assert back.chat["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    # streamed: the reasoning item's done event carries it too
    stream = EventStream(req.echo, opaque=True)
    events = stream.feed({"id": "chatcmpl-x", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"reasoning": "add them"}, "finish_reason": None}]})
    events += stream.feed({"id": "chatcmpl-x", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "4"}, "finish_reason": "stop"}]}) + stream.finish()
    done = [json.loads(e.split(b"data: ", 1)[1]) for e in events if b"response.output_item.done" in e]
    assert done[0]["item"]["encrypted_content"] == item["encrypted_content"]


# --- through the router, with everything a stream can carry ---------------------------------------


def test_streamed_choices_add_up_to_the_body_through_the_router(cluster_factory):  # noqa: F811
    c = cluster_factory(reasoning_parser="deepseek_r1")
    body = {"model": c.router.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "n": 2, "seed": 3, "logprobs": True, "top_logprobs": 1}
    whole = httpx.post(c.url + "/v1/chat/completions", json=body, timeout=10).json()
    streamed = sse_payloads(httpx.post(c.url + "/v1/chat/completions", timeout=10, json={
        **body, "stream": True, "stream_interval": 3, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}}).text)
    for choice in whole["choices"]:
        # deepseek_r1 without </think>: the whole reply is reasoning, its tokens' logprobs all there
        message = choice["message"]
        assert message["content"] is None and message["reasoning"] == message["reasoning_content"]
        assert len(choice["logprobs"]["content"]) == 9
        deltas = [ch["choices"][0] for ch in streamed if ch["choices"] and ch["choices"][0]["index"] == choice["index"]]
        assert "".join(d["delta"].get("reasoning", "") for d in deltas) == message["reasoning"]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        assert sum(len((d["logprobs"] or {}).get("content") or []) for d in deltas) == 9
        assert deltas[-1]["finish_reason"] == choice["finish_reason"] == "length"
    assert streamed[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 18
    c.all_rpcs_ended()


def test_a_forced_tool_call_and_a_regex_hold_after_the_thinking():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw in ({"tools": tools, "tool_choice": "required"},
               {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
               {"structured_outputs": {"regex": "[0-9]{2}"}},
               {"structured_outputs": {"choice": ["yes", "no"]}}):
        s = spec("deepseek_r1", **kw)
        assert s.grammar[0] == "llguidance" and validate(*s.grammar) is None, kw
        grammars = json.loads(s.grammar[1])["grammars"]
        assert grammars[1]["name"] == "pdmesh_answer" and "lark_grammar" in grammars[1]


def _tokens_in_thought(text: str, thought_end: int) -> int:
    """How many of `text`'s tokens begin before `thought_end` (the end of its </think>)."""
    ids, count, seen = ids_of(text), 0, ""
    for token in ids:
        if len(seen) < thought_end:
            count += 1
        seen += TOK.decode([token])
    return count


def ids_of(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def test_usage_counts_the_reasoning_tokens():
    reply = "Two and two.</think>Four, as ever."
    expected = _tokens_in_thought(reply, reply.index("</think>") + len("</think>"))
    assert 0 < expected < len(ids_of(reply))
    body = body_of(spec("deepseek_r1"), reply)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    # streamed: the same count in the usage chunk, and per chunk with continuous usage
    s = spec("deepseek_r1", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    state = ResponseState(s, TOK, STRINGS, "r1")
    running = []
    for step in state.feed_each(Chunk(ids_of(reply), [], "length")):
        payload = state.delta_chunk(*step)
        if payload is not None:
            running.append(payload["usage"]["completion_tokens_details"]["reasoning_tokens"])
    assert running == sorted(running) and running[-1] == expected
    assert state.usage_chunk()["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}
    # the Responses API reports the same; without a parser there is no breakdown
    assert responses_output.from_chat(body, {})["usage"]["output_tokens_details"]["reasoning_tokens"] == expected
    assert "completion_tokens_details" not in body_of(spec(None), reply)["usage"]
    # a reply that does not think: 0
    assert body_of(spec("qwen3"), "No thought.")["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
