"""OpenAI's Responses API with the `openai` SDK's own client, and Anthropic's Messages API with
the `anthropic` SDK's, through router + prefill + decode (the two share these meshes).

On the built-in model, greedy (temperature 0), so each answer is compared with what the chat
route answers for the same conversation:
- `client.responses.create(...)` non-streamed: output_text equals the chat completion's text;
  usage counts the same tokens;
- streamed (`stream=True`): the deltas join to the same text; the events come in OpenAI's order,
  numbered, ending with the whole Response;
- a tool round trip, on a tiny random Qwen2 with a tool-calling template (hermes format): a forced
  function call (a named function) comes back as a `function_call` item whose arguments
  validate against the schema, streamed and not; the call and its output go back as
  `function_call` and `function_call_output` items, and the model answers in a `message`;
- `text.format` json_schema: the reply parses and validates;
- refusals (store true, previous_response_id) are 400s naming the field; a second router on the
  same workers with --responses-store-size keeps responses: previous_response_id continues one
  (greedy: the answer the chat route gives the whole conversation), retrieve, input_items and
  delete work through the SDK.
The Messages API the same way: the reply's text equals the chat route's, streamed and not; usage
splits the chat's prompt tokens into computed and cache-read ones, and count_tokens counts the same
prompt; a stop sequence is named; a forced tool call comes back as a `tool_use` block valid against
its schema and goes back with its `tool_result`; `output_config.format` holds.
Afterwards every queue gauge is 0 and every KV pool whole.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.mesh import mesh_with_router

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
INSTRUCTIONS = "Answer in one sentence."
QUESTION = "Return the number of items in a container."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER}]
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "size": {"type": "integer"},
                   "ok": {"type": "boolean"}},
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("responses"), router_flags=("--request-timeout", "120")) as (
        m, ps, ds, r
    ):
        yield m, ps, ds, r


@pytest.fixture(scope="module")
def mesh(workers):
    m, _, _, r = workers
    return m, openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat_text(client, max_tokens: int) -> tuple[str, int, int]:
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    return out.choices[0].message.content, out.usage.prompt_tokens, out.usage.completion_tokens


def test_text_equals_chat_streamed_and_not(mesh):
    m, client = mesh
    want, prompt_tokens, completion_tokens = _chat_text(client, 24)
    resp = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                   max_output_tokens=24, store=False, metadata={"run": "test"})
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == want
    assert resp.status == ("incomplete" if completion_tokens == 24 else "completed")
    assert resp.usage.input_tokens == prompt_tokens and resp.usage.output_tokens == completion_tokens
    assert resp.usage.total_tokens == prompt_tokens + completion_tokens
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"

    events = list(client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                          max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want
    assert events[-1].response.usage.output_tokens == completion_tokens
    m.assert_invariants()


def test_a_message_list_input_is_the_same_conversation(mesh):
    m, client = mesh
    want, _, _ = _chat_text(client, 12)
    resp = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert resp.output_text == want
    m.assert_invariants()


@pytest.fixture(scope="module")
def tools_mesh(tmp_path_factory):
    """A tiny random Qwen2 with a Qwen2.5-style tool template (the built-in template has no tool
    role): the router parses its replies in the hermes format."""
    from services.fakes.hf_checkpoints import save_tiny_qwen2_tools

    folder = save_tiny_qwen2_tools(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-tools")
    model = ("--model", str(folder))
    with mesh_with_router(tmp_path_factory.mktemp("responses-tools"), 1, 1, model, model,
                          (*model, "--request-timeout", "120")) as (m, _, _, r):
        client = openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield m, client, folder.name


def _check_call(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id
    args = json.loads(item.arguments)
    jsonschema.validate(args, WEATHER)
    return args


def test_tool_call_round_trip(tools_mesh):
    m, client, model = tools_mesh
    forced = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice=forced, max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    _check_call(calls[0])

    # streamed: the call's arguments arrive as deltas, then whole
    with client.responses.stream(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice=forced, max_output_tokens=80, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == deltas == calls[0].arguments  # greedy: the same call
    assert [i.type for i in final.output] == ["function_call"]
    _check_call(final.output[0])

    # the round trip: the call and its output go back as items; the model answers in text
    follow = client.responses.create(model=model, tools=TOOLS, tool_choice="none", max_output_tokens=16,
                                     temperature=0, input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         calls[0].model_dump(exclude_none=True),
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": json.dumps({"temperature": 21})}])
    assert [i.type for i in follow.output] == ["message"]
    assert follow.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt
    m.assert_invariants()


def test_json_schema_format(mesh):
    m, client = mesh
    fmt = {"format": {"type": "json_schema", "name": "record", "schema": RECORD, "strict": True}}
    resp = client.responses.create(model=MODEL, input="Describe a record as JSON.", text=fmt,
                                   max_output_tokens=120, temperature=0)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), RECORD)
    events = list(client.responses.create(model=MODEL, input="Describe a record as JSON.", text=fmt,
                                          max_output_tokens=120, temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == resp.output_text and events[-1].type == "response.completed"
    m.assert_invariants()


def test_stored_responses_with_the_sdk(workers):
    m, ps, ds, _ = workers
    r = m.start_router(ps, ds, "--request-timeout", "120", "--responses-store-size", "16")
    client = openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0, timeout=120)
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                    max_output_tokens=12)
    assert first.store is True
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input="Why?", temperature=0,
                                     max_output_tokens=12)
    # the instructions do not carry over; the earlier turn and its answer do
    want = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why?"}])
    assert follow.output_text == want.choices[0].message.content
    assert follow.usage.input_tokens == want.usage.prompt_tokens and follow.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", QUESTION)]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=4)
    m.assert_invariants()


def test_stateful_requests_are_refused(mesh):
    m, client = mesh
    for extra in ({"store": True}, {"previous_response_id": "resp_123"}, {"background": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
        assert e.value.body["param"] == next(iter(extra))
    m.assert_invariants()


# --- Anthropic's Messages API -------------------------------------------------------------------

# long enough that the conversation's prompt fills whole KV pages the prefix cache can give back
SYSTEM = "You are a careful assistant. " * 4 + INSTRUCTIONS


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def messages_client(mesh):
    m, openai_client = mesh
    return m, openai_client, _anthropic(str(openai_client.base_url).removesuffix("/v1/"))


def test_messages_text_equals_chat_streamed_and_not(messages_client):
    m, chat, client = messages_client
    want = chat.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    kw = dict(model=MODEL, system=SYSTEM, max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
              extra_body={"temperature": 0}, metadata={"user_id": "test"})
    msg = client.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want.choices[0].message.content
    assert msg.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    usage = msg.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert usage.output_tokens == want.usage.completion_tokens and usage.cache_creation_input_tokens == 0
    # the same conversation again: its whole pages come from the prefix cache, and say so
    again = client.messages.create(**kw).usage
    assert again.cache_read_input_tokens >= 16 and again.input_tokens + again.cache_read_input_tokens == (
        want.usage.prompt_tokens)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == want.usage.prompt_tokens

    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.content[0].text == text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == want.usage.prompt_tokens
    m.assert_invariants()


def test_messages_stop_sequence_is_named(messages_client):
    m, _, client = messages_client
    kw = dict(model=MODEL, system=SYSTEM, max_tokens=24, messages=[{"role": "user", "content": QUESTION}],
              extra_body={"temperature": 0})
    whole = client.messages.create(**kw).content[0].text
    stop = whole[len(whole) // 2:][:2]  # a piece of what greedy decoding writes: the reply stops ahead of it
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    text = cut.content[0].text if cut.content else ""  # an empty reply has no text block
    assert whole.startswith(text) and stop not in text
    m.assert_invariants()


def test_messages_prefill_is_continued(messages_client):
    m, chat, client = messages_client
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The number"}]
    want = chat.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=turns,
                                        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    msg = client.messages.create(model=MODEL, max_tokens=12, messages=turns, extra_body={"temperature": 0})
    # the reply holds what follows the prefill, as Anthropic's does
    assert msg.content[0].text == want.choices[0].message.content
    m.assert_invariants()


def test_messages_tool_round_trip(tools_mesh):
    m, chat, model = tools_mesh
    client = _anthropic(str(chat.base_url).removesuffix("/v1/"))
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER}]
    kw = dict(model=model, max_tokens=80, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body={"temperature": 0})
    first = client.messages.create(**kw)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    # streamed: the input arrives as JSON deltas that add up to the same call (greedy)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == call.input and final.content[0].input == call.input
    assert final.stop_reason == "tool_use"
    # the round trip: the call and its result go back; the model answers in text
    follow = client.messages.create(model=model, max_tokens=16, tools=tools, tool_choice={"type": "none"},
                                    extra_body={"temperature": 0}, messages=[
                                        {"role": "user", "content": "What is the weather in Paris?"},
                                        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
                                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                                      "content": json.dumps({"temperature": 21})}]}])
    assert [b.type for b in follow.content] == ["text"]
    follow_prompt = follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    assert follow_prompt > first.usage.input_tokens + first.usage.cache_read_input_tokens
    m.assert_invariants()


def test_messages_output_format(messages_client):
    m, _, client = messages_client
    out = client.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "A record?"}],
                                 output_config={"format": {"type": "json_schema", "schema": RECORD}},
                                 extra_body={"temperature": 0})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), RECORD)
    m.assert_invariants()
