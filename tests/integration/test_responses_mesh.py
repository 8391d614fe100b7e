"""OpenAI's Responses API with the `openai` SDK's own client, through router + prefill + decode.

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
- refusals (store true, previous_response_id) are 400s naming the field.
Afterwards every queue gauge is 0 and every KV pool whole.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.mesh import mesh_with_router

openai = pytest.importorskip("openai")
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
def mesh(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("responses"), router_flags=("--request-timeout", "120")) as (
        m, _, _, r
    ):
        yield m, openai.OpenAI(base_url=r.http_url + "/v1", api_key="x", max_retries=0, timeout=120)


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


def test_stateful_requests_are_refused(mesh):
    m, client = mesh
    for extra in ({"store": True}, {"previous_response_id": "resp_123"}, {"background": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
        assert e.value.body["param"] == next(iter(extra))
    m.assert_invariants()
