"""POST /v1/messages and /v1/messages/count_tokens through the router's HTTP app, against scripted
in-process gRPC workers, and with Anthropic's own Python client.

The fakes "generate" the bytes of "Hello" (services/fakes/workers.py), so a request for 5 tokens is
cut by max_tokens: stop_reason `max_tokens`.
"""

from __future__ import annotations

import httpx
import pytest

from tests.unit.test_messages_request import parse_events
from tests.unit.test_router_app import MODEL, StreamThatFails, cluster, cluster_factory, post  # noqa: F401 - fixtures


def messages(**kw):
    return {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_message_json(cluster):  # noqa: F811
    r = post(cluster, "/v1/messages", messages(system="Be brief.", metadata={"user_id": "u"}),
             headers={"X-Request-Id": "my-id-1", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "msg_my-id-1" and r.headers["x-request-id"] == "my-id-1"
    assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == MODEL
    assert body["content"] == [{"type": "text", "text": "Hello"}]
    assert body["stop_reason"] == "max_tokens" and body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["output_tokens"] == 5 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    # the system prompt went first, through the chat template: the prompt counts it
    counted = post(cluster, "/v1/messages/count_tokens", messages(system="Be brief.")).json()
    assert counted == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    assert counted["input_tokens"] > post(cluster, "/v1/messages/count_tokens", messages()).json()["input_tokens"]
    cluster.all_rpcs_ended()


def test_message_stream(cluster):  # noqa: F811
    r = post(cluster, "/v1/messages", messages(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = [e for e in parse_events(r.content) if e["type"] != ":comment"]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] > 0
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hello"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 5
    cluster.all_rpcs_ended()


@pytest.mark.parametrize("body, status, kind, field", [
    (messages(max_tokens=None), 400, "invalid_request_error", "max_tokens"),
    (messages(temperature=5), 400, "invalid_request_error", "temperature"),
    (messages(max_tokens=100_000), 400, "invalid_request_error", "max_tokens"),  # over the context: chat's check
    (messages(tools=[{"name": "bad name!", "input_schema": {"type": "object"}}]), 400, "invalid_request_error",
     "tools[0].name"),
    (messages(stop_sequences=["x" * 1000]), 400, "invalid_request_error", "stop_sequences"),
    (messages(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "invalid_request_error", "messages[0].content[0].type"),
    # no --reasoning-parser here: a thinking budget has nothing to bound
    (messages(thinking={"type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error",
     "thinking.budget_tokens"),
    (messages(model="nope"), 404, "not_found_error", "model"),
])
def test_refusals_never_reach_a_worker(cluster, body, status, kind, field):  # noqa: F811
    r = post(cluster, "/v1/messages", body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"].startswith(field + ": "), error
    assert cluster.total_rooms() == 0


def test_count_tokens_refusals(cluster):  # noqa: F811
    r = post(cluster, "/v1/messages/count_tokens", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: ")
    r = post(cluster, "/v1/messages/count_tokens", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert cluster.total_rooms() == 0


def test_api_key_as_x_api_key_or_bearer(cluster_factory):  # noqa: F811
    c = cluster_factory(api_key="sekret")
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = post(c, "/v1/messages", messages(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"},
                    {"Authorization": "Bearer other", "x-api-key": "sekret"}):
        assert post(c, "/v1/messages", messages(), headers=headers).status_code == 200
    # the same key header on the OpenAI routes
    assert post(c, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                headers={"x-api-key": "sekret"}).status_code == 200
    assert post(c, "/v1/messages/count_tokens", messages(), headers={"x-api-key": "wrong"}).status_code == 401


def test_failure_mid_stream_is_an_error_event_and_keeps_connection(cluster_factory):  # noqa: F811
    s = StreamThatFails(cluster_factory, "/v1/messages", messages(stream=True, max_tokens=20))
    events = [e for e in parse_events(s.text.encode()) if e["type"] != ":comment"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hel"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] in ("api_error", "overloaded_error")
    assert s.again(messages())["content"][0]["text"] == "Hello"


def test_anthropic_sdk_against_fakes(cluster_factory):  # noqa: F811
    anthropic = pytest.importorskip("anthropic")
    c = cluster_factory(api_key="sekret")
    client = anthropic.Anthropic(base_url=c.url, api_key="sekret", max_retries=0)
    out = client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert out.content[0].text == "Hello" and out.stop_reason == "max_tokens" and out.usage.output_tokens == 5
    with client.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as stream:
        assert "".join(stream.text_stream) == "Hello"
        final = stream.get_final_message()
    assert final.content[0].text == "Hello" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == out.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               stop_sequences=["x" * 1000])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=c.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    c.all_rpcs_ended()


def test_openapi_lists_the_routes(cluster):  # noqa: F811
    schema = httpx.get(cluster.url + "/openapi.json").json()
    for path, name in (("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert schema["components"]["schemas"][name]["properties"]["model"]["enum"][0] == MODEL
