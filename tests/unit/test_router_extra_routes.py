"""vLLM's endpoints and request-id rule on the real app (uvicorn, gRPC) with scripted workers:
/tokenize, /detokenize, /version, /ping, /load, and X-Request-Id / request_id echoed as the response id."""

from __future__ import annotations

import httpx

from services.common.tokenizer import load_tokenizer
from tests.unit.test_router_app import MODEL, cluster, cluster_factory  # noqa: F401 - fixtures

TOK = load_tokenizer("builtin-random")


def test_tokenize_a_prompt_and_messages(cluster):  # noqa: F811
    r = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": "hello"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == TOK.encode("hello") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == cluster.router.info.context_length and body["token_strs"] is None
    r = httpx.post(cluster.url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert r.json()["tokens"] == TOK.encode("hi", add_special_tokens=False)
    assert "".join(r.json()["token_strs"]) == "hi"
    messages = [{"role": "user", "content": "hello"}]
    r = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert r.json()["tokens"] == TOK.encode_chat(messages)
    open_ended = httpx.post(cluster.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert open_ended.json()["count"] < r.json()["count"]


def test_tokenize_and_detokenize_refuse_bad_input(cluster):  # noqa: F811
    for path, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
        ("/tokenize", {"messages": "x"}, "messages"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ]:
        r = httpx.post(cluster.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    r = httpx.post(cluster.url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404
    # the generation routes' reading of `model`: not a string is a 400, empty is the served model
    r = httpx.post(cluster.url + "/tokenize", json={"model": 3, "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert httpx.post(cluster.url + "/tokenize", json={"model": "", "prompt": "x"}).status_code == 200
    r = httpx.post(cluster.url + "/tokenize", content=b"{not json")
    assert r.status_code == 400


def test_detokenize_round_trips(cluster):  # noqa: F811
    ids = TOK.encode("round trip", add_special_tokens=False)
    r = httpx.post(cluster.url + "/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "round trip"}


def test_load_counts_what_is_being_served(cluster):  # noqa: F811
    assert httpx.get(cluster.url + "/load").json() == {"server_load": 0}
    cluster.decodes[0].behaviour.token_delay = 0.05  # a stream that lasts long enough to be seen
    with httpx.stream("POST", cluster.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "x", "max_tokens": 40, "n": 2, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # one iterator: a dropped one closes the stream
        next(lines)  # under way
        assert httpx.get(cluster.url + "/load").json() == {"server_load": 2}  # counted per choice
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and sum('"finish_reason":"length"' in line for line in rest) == 2
    assert httpx.get(cluster.url + "/load").json() == {"server_load": 0}
    cluster.all_rpcs_ended()


def test_version_and_ping(cluster):  # noqa: F811
    assert httpx.get(cluster.url + "/version").json()["version"]
    assert httpx.get(cluster.url + "/ping").status_code == 200
    assert httpx.post(cluster.url + "/ping").status_code == 200


def test_api_key_guards_tokenize(cluster_factory):  # noqa: F811
    c = cluster_factory(api_key="k")
    assert httpx.post(c.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    ok = httpx.post(c.url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200
    assert httpx.get(c.url + "/ping").status_code == 200


def test_x_request_id_is_echoed_and_names_the_response(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    r = httpx.post(cluster.url + "/v1/completions", json=body, headers={"X-Request-Id": "my-trace-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-trace-1"
    assert r.json()["id"] == "cmpl-my-trace-1"
    r = httpx.post(cluster.url + "/v1/completions", json={**body, "request_id": "from-body"})
    assert r.headers["x-request-id"] == "from-body" and r.json()["id"] == "cmpl-from-body"
    # the header wins over the body, as vLLM's
    r = httpx.post(cluster.url + "/v1/completions", json={**body, "request_id": "b"}, headers={"X-Request-Id": "h"})
    assert r.json()["id"] == "cmpl-h"
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", headers={"X-Request-Id": "s-1"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                            "stream": True}) as s:
        assert s.headers["x-request-id"] == "s-1"
        assert "chatcmpl-s-1" in s.read().decode()
    r = httpx.post(cluster.url + "/v1/completions", json={**body, "max_tokens": 10**9},
                   headers={"X-Request-Id": "err-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "err-1"
    r = httpx.post(cluster.url + "/v1/completions", json=body, headers={"X-Request-Id": "a b"})
    assert r.status_code == 400
    # without one the router names the request itself
    r = httpx.post(cluster.url + "/v1/completions", json=body)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    cluster.all_rpcs_ended()


def test_invocations_answers_chat_and_completion_bodies(cluster_factory):  # noqa: F811
    # SageMaker's route (vLLM's): the body says which API it is, and the answer is that route's
    c = cluster_factory(api_key="k")
    auth = {"Authorization": "Bearer k"}
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    chat = httpx.post(c.url + "/invocations", json=chat_body, headers=auth).json()
    direct = httpx.post(c.url + "/v1/chat/completions", json=chat_body, headers=auth).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == direct["choices"][0]["message"]
    text = httpx.post(c.url + "/invocations", json={"model": MODEL, "prompt": "hi", "max_tokens": 5}, headers=auth)
    assert text.json()["object"] == "text_completion" and text.json()["choices"][0]["text"] == "Hello"
    with httpx.stream("POST", c.url + "/invocations", json={**chat_body, "stream": True}, headers=auth) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and '"chat.completion.chunk"' in data[0]
    neither = httpx.post(c.url + "/invocations", json={"model": MODEL, "input": "hi"}, headers=auth)
    assert neither.status_code == 400 and "'messages'" in neither.json()["error"]["message"]
    bad = httpx.post(c.url + "/invocations", json={**chat_body, "max_tokens": 0}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the chat route's checks
    assert httpx.post(c.url + "/invocations", json=chat_body).status_code == 401
    c.all_rpcs_ended()
