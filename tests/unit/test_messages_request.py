"""Anthropic's Messages API, the pure parts: a Messages body -> the chat body that serves it
(services/router/messages_request.py), a chat completion -> a Message (messages_output.py), and the
chat stream's chunks -> the Messages events (messages_stream.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.router import messages_output as out
from services.router.errors import APIError
from services.router.messages_request import translate
from services.router.messages_stream import EventStream, translate_sse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def body(**kw):
    return {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(b, param: str | None) -> APIError:
    with pytest.raises(APIError) as e:
        translate(b)
    assert e.value.status == 400 and e.value.param == param, e.value
    return e.value


def test_plain_request_maps_onto_chat():
    req = translate(body(system="Be brief.", stop_sequences=["\n\n"], temperature=0.2, top_p=0.9, top_k=5,
                         metadata={"user_id": "u1"}, service_tier="auto", cache_control={"type": "ephemeral"},
                         priority=-2))
    assert req.chat == {"model": "m", "max_tokens": 10, "stop": ["\n\n"], "temperature": 0.2, "top_p": 0.9,
                        "top_k": 5, "priority": -2, "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}]}
    assert req.model == "m" and not req.stream
    streamed = translate(body(stream=True))
    assert streamed.stream and streamed.chat["stream"] is True
    # every chunk carries usage: message_start needs the prompt's tokens before any text
    assert streamed.chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_system_blocks_and_system_messages_join_and_the_per_request_header_is_dropped():
    req = translate(body(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"},
                                 {"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}],
                         messages=[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "hi"}]))
    assert req.chat["messages"] == [{"role": "system", "content": "You are a coder.\nUse tools."},
                                    {"role": "user", "content": "hi"}]


def test_a_tool_round_trip_becomes_chat_messages_in_template_order():
    req = translate(body(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lima"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no such"},
                                                                          {"type": "text", "text": "city"}],
             "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]))
    assert req.chat["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such\ncity"},
        {"role": "user", "content": "And tomorrow?"}]
    # each chat message knows the Messages field it came from, for errors
    assert req.origins == ("messages[0]", "messages[1]", "messages[2]", "messages[2]", "messages[2]")
    assert req.field("messages[3].content") == "messages[2]"


def test_a_final_assistant_text_is_continued():
    prefill = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": [{"type": "text", "text": "{"}]}]
    assert translate(body(messages=prefill)).chat["continue_final_message"] is True
    assert translate(body(messages=[*prefill[:1], {"role": "assistant", "content": "{"}])).chat["continue_final_message"]
    # a turn that ends in a call, or an earlier assistant turn, is not continued
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
    assert "continue_final_message" not in translate(body(messages=[prefill[0], call])).chat
    assert "continue_final_message" not in translate(body(messages=[*prefill, {"role": "user", "content": "x"}])).chat


def test_tools_tool_choice_thinking_and_output_config():
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER,
              "cache_control": {"type": "ephemeral"}}, {"type": "custom", "name": "t2", "input_schema": WEATHER,
                                                        "strict": True}]
    req = translate(body(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert req.chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "description": "Weather"}},
        {"type": "function", "function": {"name": "t2", "parameters": WEATHER, "strict": True}}]
    assert req.chat["tool_choice"] == "required" and req.chat["parallel_tool_calls"] is False
    for choice, want in (({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                         ({"type": "tool", "name": "t2"}, {"type": "function", "function": {"name": "t2"}})):
        chat = translate(body(tools=tools, tool_choice=choice)).chat
        assert chat["tool_choice"] == want and "parallel_tool_calls" not in chat
    thinking = translate(body(thinking={"type": "enabled", "budget_tokens": 2048},
                              chat_template_kwargs={"custom": 1})).chat
    assert thinking["thinking_token_budget"] == 2048
    assert thinking["chat_template_kwargs"] == {"custom": 1, "enable_thinking": True}
    adaptive = translate(body(thinking={"type": "adaptive", "display": "omitted"})).chat
    assert adaptive["chat_template_kwargs"] == {"enable_thinking": True} and "thinking_token_budget" not in adaptive
    assert adaptive["include_reasoning"] is False
    off = translate(body(thinking={"type": "disabled"})).chat
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and "thinking_token_budget" not in off
    fmt = translate(body(output_config={"effort": "low", "format": {"type": "json_schema", "schema": WEATHER}})).chat
    assert fmt["reasoning_effort"] == "low"
    assert fmt["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": WEATHER}}
    legacy = translate(body(output_format={"type": "json_schema", "schema": WEATHER})).chat
    assert legacy["response_format"] == fmt["response_format"]


def test_count_only_needs_no_max_tokens():
    b = body()
    del b["max_tokens"]
    assert "max_tokens" not in translate(b, count_only=True).chat
    refused(b, "max_tokens")


@pytest.mark.parametrize("b, param", [
    ([1], None),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
    (body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages[0].content[0].type"),
    (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (body(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (body(messages=[]), "messages"),
    (body(messages=[{"role": "system", "content": "only a system prompt"}]), "messages"),
    (body(messages=[{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "..."}]}]),
     "messages[0].content[0].type"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]),
     "messages[0].content[0].input"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
     "messages[0].content[0].tool_use_id"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]),
     "messages[0].content[0].is_error"),
    (body(system=[{"type": "image"}]), "system[0].type"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens="10"), "max_tokens"),
    (body(stop_sequences="x"), "stop_sequences"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (body(tool_choice={"type": "function"}), "tool_choice.type"),
    (body(tool_choice={"type": "tool"}), "tool_choice.name"),
    (body(tool_choice={"type": "any", "disable_parallel_tool_use": 1}), "tool_choice.disable_parallel_tool_use"),
    (body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (body(thinking={"type": "enabled", "budget_tokens": 0}), "thinking.budget_tokens"),
    (body(thinking={"type": "sometimes"}), "thinking.type"),
    (body(thinking={"type": "between_tools"}), "thinking.type"),
    (body(thinking={"type": "adaptive", "display": "full"}), "thinking.display"),
    (body(output_config={"format": {"type": "json_object"}}), "output_config.format.type"),
    (body(output_config={"effort": 3}), "output_config.effort"),
    (body(metadata={"user_id": 5}), "metadata.user_id"),
    (body(container="c1"), "container"),
    (body(mcp_servers=[{"url": "x"}]), "mcp_servers"),
])
def test_refusals_name_the_messages_field(b, param):
    refused(b, param)  # the route puts the field ahead of the message, as Anthropic's errors read


def test_chat_refusals_are_named_in_messages_terms():
    req = translate(body(system="s", stop_sequences=["a"], tools=[{"name": "f", "input_schema": WEATHER}],
                         messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]))
    assert req.field("stop") == "stop_sequences" and req.field("stop[0]") == "stop_sequences[0]"
    assert req.field("tools[0].function.parameters") == "tools[0].input_schema"
    assert req.field("tools[0].function.name") == "tools[0].name"
    assert req.field("tool_choice.function.name") == "tool_choice.name"
    assert req.field("response_format.json_schema.schema") == "output_config.format"
    assert req.field("thinking_token_budget") == "thinking.budget_tokens"
    assert req.field("messages[0]") == "system" and req.field("messages[2].content") == "messages[1]"
    assert req.field("temperature") == "temperature"


# --- chat completion -> Message -----------------------------------------------------------------


def chat_body(message, finish_reason="stop", stop_reason=None, cached=0):
    return {"id": "chatcmpl-abc", "model": "served", "choices": [
        {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason,
         "stop_reason": stop_reason}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
                  "prompt_tokens_details": {"cached_tokens": cached}}}


def test_message_from_chat():
    msg = out.from_chat(chat_body({"content": "Hi there", "reasoning": "hmm"}, cached=16), "m")
    assert msg == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                               {"type": "text", "text": "Hi there"}],
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                             "output_tokens": 7}}
    calls = out.from_chat(chat_body({"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}), None)
    assert calls["content"] == [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"city": "Paris"}}]
    assert calls["stop_reason"] == "tool_use" and calls["model"] == "served"
    assert out.from_chat(chat_body({"content": "ab"}, "length"), "m")["stop_reason"] == "max_tokens"
    seq = out.from_chat(chat_body({"content": "ab"}, "stop", "\n\n"), "m")
    assert (seq["stop_reason"], seq["stop_sequence"]) == ("stop_sequence", "\n\n")
    # a stop token (an int) is the end of the turn, as the eos is
    assert out.from_chat(chat_body({"content": "ab"}, "stop", 2047), "m")["stop_reason"] == "end_turn"
    assert out.from_chat(chat_body({"content": ""}), "m")["content"] == []


# --- the event stream ---------------------------------------------------------------------------


def chunk(delta=None, finish=None, stop_reason=None, usage=None):
    choices = [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish, **({"stop_reason": stop_reason} if finish else {})}]
    return {"id": "chatcmpl-abc", "model": "served", "choices": choices, "usage": usage}


USAGE = {"prompt_tokens": 20, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 16}}


def parse_events(raw: bytes) -> list[dict]:
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        if block.startswith(":"):
            events.append({"type": ":comment"})
            continue
        head, data = block.split("\n")
        payload = json.loads(data[len("data: "):])
        assert head == "event: " + payload["type"]
        events.append(payload)
    return events


def test_stream_events_for_a_thought_text_and_calls():
    s = EventStream("m")
    raw = b"".join(
        s.feed(chunk({"role": "assistant", "content": ""}, usage=USAGE))
        + s.feed(chunk({"reasoning": "let me "}, usage=USAGE))
        + s.feed(chunk({"reasoning": "see"}, usage=USAGE))
        + s.feed(chunk({"content": "Sure."}, usage=USAGE))
        + s.feed(chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": '{"city": '}}]}))
        + s.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}))
        + s.feed(chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                        "function": {"name": "g", "arguments": "{}"}}]}, finish="tool_calls"))
        + s.feed(chunk(usage={**USAGE, "completion_tokens": 9}))
        + s.finish() + s.finish())
    events = parse_events(raw)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["id"] == "msg_abc" and start["model"] == "m" and start["content"] == []
    assert start["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                              "output_tokens": 0}
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[5]["content_block"] == {"type": "text", "text": ""}
    assert events[8]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[9:11]) == '{"city": "Paris"}'
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 9


def test_stream_stop_sequence_and_error_events():
    s = EventStream(None)
    events = parse_events(b"".join(s.feed(chunk({"content": "ab"}, usage=USAGE))
                                   + s.feed(chunk({"content": ""}, finish="stop", stop_reason="\n"))
                                   + s.finish()))
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n"}
    failed = EventStream("m")
    events = parse_events(b"".join(failed.feed(chunk({"content": "ab"}, usage=USAGE))
                                   + failed.feed({"error": {"message": "decode died", "type": "service_unavailable_error"}})
                                   + failed.feed(chunk({"content": "late"})) + failed.finish()))
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "decode died"}


def test_translate_sse_cuts_chat_events_out_of_any_chunking_and_keeps_comments():
    chat = (b"data: " + json.dumps(chunk({"content": "Hel"}, usage=USAGE)).encode() + b"\n\n: keep-alive\n\n"
            + b"data: " + json.dumps(chunk({"content": "lo"}, finish="length", usage=USAGE)).encode() + b"\n\n"
            + b"data: [DONE]\n\n")

    async def pieces(size):
        for i in range(0, len(chat), size):
            yield chat[i:i + size]

    async def run(size):
        return b"".join([part async for part in translate_sse(pieces(size), "m")])

    whole = asyncio.run(run(len(chat)))
    for size in (1, 7, 50):
        assert asyncio.run(run(size)) == whole
    events = parse_events(whole)
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                           ":comment", "content_block_delta", "content_block_stop",
                                           "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
