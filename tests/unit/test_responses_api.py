"""POST /v1/responses through the router's HTTP app, against scripted in-process gRPC workers.

The fakes "generate" the bytes of "Hello" (services/fakes/workers.py), so a request for 5 tokens is
cut by max_output_tokens: `incomplete`, as OpenAI reports it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.unit.test_router_app import MODEL, StreamThatFails, cluster, cluster_factory, post  # noqa: F401 - fixtures


def responses(**kw):
    return {"model": MODEL, "input": "hi", "max_output_tokens": 5, **kw}


def events_of(text: str) -> list[dict]:
    """Parse the Responses SSE body strictly: `event:` + `data:` pairs, no [DONE]."""
    assert "[DONE]" not in text
    out = []
    for raw in text.split("\n\n")[:-1]:
        head, data = raw.split("\n")
        payload = json.loads(data[len("data: "):])
        assert head == "event: " + payload["type"]
        out.append(payload)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_response_json(cluster):  # noqa: F811
    r = post(cluster, "/v1/responses", responses(instructions="Be brief.", metadata={"k": "v"}),
             headers={"X-Request-Id": "my-id-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "resp_my-id-1" and r.headers["x-request-id"] == "my-id-1"
    assert body["object"] == "response" and body["model"] == MODEL
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["type"] == "message" and body["output"][0]["content"][0]["text"] == "Hello"
    assert body["usage"]["output_tokens"] == 5 and body["usage"]["input_tokens"] > 0
    assert body["instructions"] == "Be brief." and body["metadata"] == {"k": "v"} and body["store"] is False
    # the instructions went first, as a system message, through the chat template
    assert len(cluster.decodes[0].seen.requests[0].token_ids) > len(
        post(cluster, "/tokenize", {"model": MODEL, "prompt": "hi"}).json()["tokens"])
    cluster.all_rpcs_ended()


def test_response_stream(cluster):  # noqa: F811
    r = post(cluster, "/v1/responses", responses(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 5
    cluster.all_rpcs_ended()


@pytest.mark.parametrize("body, status, param", [
    (responses(store=True), 400, "store"),
    (responses(previous_response_id="resp_x"), 400, "previous_response_id"),
    (responses(background=True), 400, "background"),
    (responses(temperature=5), 400, "temperature"),
    (responses(max_output_tokens=100_000), 400, "max_output_tokens"),  # over the context: chat's check, renamed
    (responses(tools=[{"type": "function", "name": "bad name!"}]), 400, "tools[0].name"),
    (responses(model="nope"), 404, "model"),
])
def test_refusals_never_reach_a_worker(cluster, body, status, param):  # noqa: F811
    r = post(cluster, "/v1/responses", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert cluster.total_rooms() == 0


def test_failure_mid_stream_is_response_failed_and_keeps_connection(cluster_factory):  # noqa: F811
    s = StreamThatFails(cluster_factory, "/v1/responses", responses(stream=True, max_output_tokens=20))
    events = events_of(s.text)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hel"
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert s.again(responses())["output"][0]["content"][0]["text"] == "Hello"


def test_openai_sdk_responses_against_fakes(cluster):  # noqa: F811
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    assert out.output_text == "Hello" and out.status == "incomplete" and out.usage.output_tokens == 5
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=5) as stream:
        events = list(stream)
    # cut by max_output_tokens: the stream ends with response.incomplete, as OpenAI's does (the
    # helper's get_final_response() only takes response.completed)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "Hello"
    kinds = [e.type for e in client.responses.create(model=MODEL, input="hi", max_output_tokens=5, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", store=True)
    cluster.all_rpcs_ended()


def test_openapi_lists_the_route(cluster):  # noqa: F811
    schema = httpx.get(cluster.url + "/openapi.json").json()
    body = schema["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert schema["components"]["schemas"]["ResponsesRequest"]["properties"]["model"]["enum"][0] == MODEL
