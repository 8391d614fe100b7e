"""Stored responses (--responses-store-size): the store's bounds, the translation of store and
previous_response_id, and the routes (GET / DELETE /v1/responses/{id}, input_items) through the
router's app against scripted in-process workers."""

from __future__ import annotations

import json

import httpx
import pytest

from services.router.errors import APIError
from services.router.responses_request import translate
from services.router.responses_route import make_store
from services.router.responses_store import ResponsesStore
from tests.unit.test_router_app import MODEL, cluster_factory, post  # noqa: F401 - fixtures


def response(rid: str, text: str = "Hello") -> dict:
    return {"id": rid, "object": "response", "status": "completed", "output": [
        {"id": "msg_" + rid, "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}


def test_the_store_drops_the_least_recently_used_by_count_and_by_bytes():
    store = ResponsesStore(max_entries=2, max_bytes=10_000)
    for rid in ("a", "b"):
        assert store.put(response(rid), [], [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put(response("c"), [], [])
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    small = ResponsesStore(max_entries=100, max_bytes=700)
    for rid in ("a", "b", "c"):
        small.put(response(rid, "x" * 100), [], [])
    assert small.bytes <= 700 and small.get("a") is None and small.get("c") is not None
    assert not small.put(response("huge", "x" * 1000), [], [])  # alone over the bound: not kept
    assert small.delete("c") and not small.delete("c") and small.get("c") is None
    with pytest.raises(ValueError):
        ResponsesStore(0, 1)


def test_store_settings():
    class Settings:
        responses_store_size, responses_store_bytes, processes = 0, 1 << 20, 1
    assert make_store(Settings()) is None
    Settings.responses_store_size = 4
    assert isinstance(make_store(Settings()), ResponsesStore)
    Settings.processes = 2  # one process's memory: a follow-up on another process would not find it
    with pytest.raises(ValueError, match="--processes 1"):
        make_store(Settings())


def test_previous_response_id_puts_the_stored_conversation_first():
    store = ResponsesStore(8, 1 << 20)
    first = translate({"model": MODEL, "input": "Hi", "instructions": "Be brief."}, store)
    assert first.store and first.echo["store"] is True  # with a store, OpenAI's default: stored
    assert first.input_items == [{"type": "message", "role": "user", "content": "Hi"}]
    answer = response("resp_1", "Hello!")
    store.put(answer, first.input_items, first.context + answer["output"])
    follow = translate({"model": MODEL, "input": "And you?", "previous_response_id": "resp_1",
                        "instructions": "Answer in French.", "store": False}, store)
    # the new instructions, the earlier turn and its answer, then the new input; the earlier
    # instructions do not carry over, as in OpenAI's API
    assert follow.chat["messages"] == [{"role": "system", "content": "Answer in French."},
                                       {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "And you?"}]
    assert not follow.store and follow.echo["previous_response_id"] == "resp_1"
    with pytest.raises(APIError) as e:
        translate({"model": MODEL, "input": "x", "previous_response_id": "resp_gone"}, store)
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    # stateless: both are 400s naming the field and the flag
    for extra, field in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        with pytest.raises(APIError) as e:
            translate({"model": MODEL, "input": "x", **extra})
        assert e.value.status == 400 and e.value.param == field and "--responses-store-size" in e.value.message


def test_stored_responses_through_the_app(cluster_factory):  # noqa: F811
    c = cluster_factory(responses_store_size=8)
    first = post(c, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5}).json()
    assert first["store"] is True
    got = httpx.get(f"{c.url}/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    items = httpx.get(f"{c.url}/v1/responses/{first['id']}/input_items").json()
    assert items["object"] == "list" and not items["has_more"]
    assert [i["content"] for i in items["data"]] == [[{"type": "input_text", "text": "hi"}]]
    assert items["data"][0]["id"].startswith("msg_") and items["first_id"] == items["data"][0]["id"]

    # the follow-up's prompt holds the first turn: more tokens reach the workers
    follow = post(c, "/v1/responses", {"model": MODEL, "input": "more", "max_output_tokens": 5,
                                       "previous_response_id": first["id"]}).json()
    assert follow["previous_response_id"] == first["id"]
    alone = post(c, "/v1/responses", {"model": MODEL, "input": "more", "max_output_tokens": 5, "store": False}).json()
    prompts = [len(r.token_ids) for r in c.decodes[0].seen.requests]
    assert prompts[1] > prompts[2] and follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"]
    assert httpx.get(f"{c.url}/v1/responses/{alone['id']}").status_code == 404  # store false: not kept

    # streamed responses are stored once complete
    with httpx.stream("POST", c.url + "/v1/responses", json={"model": MODEL, "input": "s", "max_output_tokens": 5,
                                                             "stream": True}) as r:
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert httpx.get(f"{c.url}/v1/responses/{final['id']}").json()["output"] == final["output"]

    deleted = httpx.delete(f"{c.url}/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    assert httpx.get(f"{c.url}/v1/responses/{first['id']}").status_code == 404
    r = post(c, "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": first["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    c.all_rpcs_ended()


def test_without_a_store_nothing_is_kept(cluster_factory):  # noqa: F811
    c = cluster_factory()
    out = post(c, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5}).json()
    assert out["store"] is False
    r = httpx.get(f"{c.url}/v1/responses/{out['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert httpx.delete(f"{c.url}/v1/responses/{out['id']}").status_code == 404


def test_the_store_routes_need_the_api_key(cluster_factory):  # noqa: F811
    c = cluster_factory(api_key="k", responses_store_size=4)
    out = post(c, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5},
               headers={"Authorization": "Bearer k"}).json()
    assert httpx.get(f"{c.url}/v1/responses/{out['id']}").status_code == 401
    assert httpx.get(f"{c.url}/v1/responses/{out['id']}", headers={"Authorization": "Bearer k"}).status_code == 200


def test_input_items_pages(cluster_factory):  # noqa: F811
    c = cluster_factory(responses_store_size=4)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    out = post(c, "/v1/responses", {"model": MODEL, "input": turns, "max_output_tokens": 2}).json()
    url = f"{c.url}/v1/responses/{out['id']}/input_items"

    def texts(page):
        return [i["content"][0]["text"] for i in page["data"]]

    assert texts(httpx.get(url).json()) == ["c", "b", "a"]  # newest first, as OpenAI's default
    first = httpx.get(url, params={"order": "asc", "limit": 2}).json()
    assert texts(first) == ["a", "b"] and first["has_more"] and first["last_id"] == first["data"][1]["id"]
    rest = httpx.get(url, params={"order": "asc", "after": first["last_id"]}).json()
    assert texts(rest) == ["c"] and not rest["has_more"]
    assert [i["content"][0]["type"] for i in httpx.get(url, params={"order": "asc"}).json()["data"]] == [
        "input_text", "output_text", "input_text"]
    for bad in ({"order": "up"}, {"limit": 0}, {"limit": "x"}):
        assert httpx.get(url, params=bad).status_code == 400
    c.all_rpcs_ended()
