"""The Responses API's translation into chat, and the Response objects and events made back: pure."""

from __future__ import annotations

import json

import pytest

from services.router.errors import APIError
from services.router.responses_output import from_chat
from services.router.responses_request import translate
from services.router.responses_route import responses_param
from services.router.responses_stream import EventStream

MODEL = "pdmesh-tiny"


def chat_of(**body):
    return translate({"model": MODEL, **body}).chat


def refused(body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        translate({"model": MODEL, "input": "hi", **body})
    assert e.value.status == 400
    return e.value


# --- requests ----------------------------------------------------------------------------------


def test_string_input_and_instructions():
    chat = chat_of(input="Hello", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert chat == {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hello"}],
                    "max_tokens": 7, "temperature": 0.5, "top_p": 0.9}


def test_message_items_with_text_parts():
    chat = chat_of(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
    ])
    assert chat["messages"] == [{"role": "developer", "content": "rules"}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": "c"}]


def test_tool_round_trip_items():
    chat = chat_of(input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": "{\"city\": \"Oslo\"}",
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}},
        {"id": "call_2", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}
    assert chat["messages"][2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                                    {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


def test_a_call_joins_the_assistant_text_before_it():
    chat = chat_of(input=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "let me look"},
                          {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert chat["messages"][1]["content"] == "let me look" and len(chat["messages"][1]["tool_calls"]) == 1


def test_tools_tool_choice_format_effort():
    params = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = chat_of(input="hi", tools=[{"type": "function", "name": "f", "description": "d", "parameters": params,
                                       "strict": True}],
                   tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                   text={"format": {"type": "json_schema", "name": "n", "schema": params, "strict": True}},
                   reasoning={"effort": "low"})
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": params, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "n", "schema": params, "strict": True}}
    assert chat["reasoning_effort"] == "low"
    assert chat_of(input="hi", text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_of(input="hi", text={"format": {"type": "text"}})


def test_vllms_cache_salt_and_priority_go_to_the_chat_route():
    assert chat_of(input="hi", cache_salt="tenant-1")["cache_salt"] == "tenant-1"
    assert "cache_salt" not in chat_of(input="hi", cache_salt=None)
    assert chat_of(input="hi", priority=-3)["priority"] == -3


def test_stream_asks_for_usage():
    req = translate({"model": MODEL, "input": "hi", "stream": True})
    assert req.stream and req.chat["stream_options"] == {"include_usage": True}


def test_informational_fields_are_accepted():
    req = translate({"model": MODEL, "input": "hi", "store": False, "metadata": {"k": "v"}, "user": "u",
                     "safety_identifier": "s", "prompt_cache_key": "p", "service_tier": "auto",
                     "truncation": "disabled", "include": [], "background": False, "some_unknown_field": 1})
    assert req.chat == {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert req.echo["metadata"] == {"k": "v"} and req.echo["store"] is False
    assert translate({"model": MODEL, "input": "hi"}).echo["store"] is False  # absent: served, nothing stored


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"metadata": "x"}, "metadata"),
])
def test_refusals_name_the_field(body, param):
    assert refused(body).param == param


def test_chat_errors_are_renamed_to_responses_fields():
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("messages[2].content") == "input"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tools[1].function.name") == "tools[1].name"
    assert responses_param("tool_choice.function.name") == "tool_choice.name"
    assert responses_param("reasoning_effort") == "reasoning.effort"
    assert responses_param("temperature") == "temperature"


# --- Response objects ----------------------------------------------------------------------------

ECHO = translate({"model": MODEL, "input": "hi"}).echo
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}


def chat_body(message: dict, finish_reason: str = "stop") -> dict:
    return {"id": "chatcmpl-00ab", "object": "chat.completion", "created": 123, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "refusal": None, **message},
                         "logprobs": None, "finish_reason": finish_reason}], "usage": USAGE}


def test_text_response():
    r = from_chat(chat_body({"content": "Hello"}), ECHO)
    assert r["id"] == "resp_00ab" and r["object"] == "response" and r["created_at"] == 123
    assert r["status"] == "completed" and r["incomplete_details"] is None and r["error"] is None
    assert r["output"] == [{"id": "msg_00ab", "type": "message", "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}]
    assert r["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    assert "output_text" not in r  # the SDK derives it
    assert r["store"] is False and r["tools"] == [] and r["tool_choice"] == "auto"


def test_cut_response_is_incomplete():
    r = from_chat(chat_body({"content": "Hel"}, "length"), ECHO)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"


def test_tool_call_response():
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]
    r = from_chat(chat_body({"content": None, "tool_calls": calls}, "tool_calls"), ECHO)
    assert r["output"] == [{"id": "fc_00ab_0", "type": "function_call", "status": "completed", "call_id": "call_a",
                            "name": "f", "arguments": "{\"x\":1}"}]


# --- events --------------------------------------------------------------------------------------


def chunk(delta: dict | None = None, finish_reason=None, usage=None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return {"id": "chatcmpl-00ab", "object": "chat.completion.chunk", "created": 123, "model": MODEL,
            "choices": choices, "usage": usage}


def decode(events: list[bytes]) -> list[dict]:
    out = []
    for raw in events:
        head, data = raw.decode().rstrip("\n").split("\n")
        payload = json.loads(data[len("data: "):])
        assert head == "event: " + payload["type"]
        out.append(payload)
    return out


def run(chunks: list[dict], finish: bool = True) -> list[dict]:
    s = EventStream(ECHO)
    events = [e for c in chunks for e in s.feed(c)]
    return decode(events + (s.finish() if finish else []))


def test_text_stream_events():
    got = run([chunk({"role": "assistant", "content": ""}), chunk({"content": "He"}), chunk({"content": "llo"}),
               chunk({}, "stop"), chunk(usage=USAGE)])
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta") == "Hello"
    assert got[6]["text"] == "Hello" and got[8]["item"]["status"] == "completed"
    final = got[-1]["response"]
    assert final == from_chat(chat_body({"content": "Hello"}), ECHO)  # the same object as unstreamed


def test_cut_stream_is_incomplete():
    got = run([chunk({"content": "Hel"}), chunk({}, "length"), chunk(usage=USAGE)])
    assert got[-1]["type"] == "response.incomplete"
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_tool_call_stream_events():
    got = run([chunk({"role": "assistant", "content": ""}),
               chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}),
               chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\""}}]}),
               chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}),
               chunk({}, "tool_calls"), chunk(usage=USAGE)])
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert got[5]["arguments"] == "{\"x\":1}" and got[5]["item_id"] == "fc_00ab_0"
    assert got[-1]["response"]["output"] == [{"id": "fc_00ab_0", "type": "function_call", "status": "completed",
                                              "call_id": "call_a", "name": "f", "arguments": "{\"x\":1}"}]


def test_error_mid_stream_is_response_failed():
    s = EventStream(ECHO)
    events = s.feed(chunk({"content": "He"})) + s.feed({"error": {"message": "decode died", "code": "worker_failure"}})
    events += s.finish()  # the chat stream's [DONE] after its error: nothing more
    got = decode(events)
    assert got[-1]["type"] == "response.failed"
    assert got[-1]["response"]["status"] == "failed"
    assert got[-1]["response"]["error"] == {"code": "server_error", "message": "decode died"}
    assert [e["type"] for e in got].count("response.failed") == 1


def test_text_after_a_call_is_a_new_message_item():
    got = run([chunk({"content": "a"}),
               chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}]}),
               chunk({"content": "b"}), chunk({}, "tool_calls"), chunk(usage=USAGE)])
    output = got[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call", "message"]
    assert len({i["id"] for i in output}) == 3
    added = [e["item"]["id"] for e in got if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in got if e["type"] == "response.output_item.done"]
    assert added == done == [i["id"] for i in output]  # each item opened and closed once, in order
