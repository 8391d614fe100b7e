"""vLLM's output fields on the real app with scripted workers (they answer b"Hello, world! ..."):
include_stop_str_in_output, continuous_usage_stats, echo on chat, batched prompts, and the
sampling fields the workers receive."""

from __future__ import annotations

import json

import httpx

from services.common.tokenizer import load_tokenizer
from services.launch.probes import wait_for
from tests.unit.test_router_app import MODEL, cluster, cluster_factory  # noqa: F401 - fixtures

TOK = load_tokenizer("builtin-random")


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_include_stop_str_in_output(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stop": [","]}
    plain = httpx.post(cluster.url + "/v1/completions", json=body).json()["choices"][0]
    kept = httpx.post(cluster.url + "/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert plain["text"] == "Hello" and kept["choices"][0]["text"] == "Hello,"
    assert kept["choices"][0]["finish_reason"] == "stop"
    events = _events(cluster.url + "/v1/completions", {**body, "stream": True, "include_stop_str_in_output": True})
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hello,"
    cluster.all_rpcs_ended()


def test_continuous_usage_stats(cluster):  # noqa: F811
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(cluster.url + "/v1/chat/completions", body)
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    prompt = usages[0]["prompt_tokens"]
    counts = [u["completion_tokens"] for u in usages[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4
    assert usages[-1] == {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert events[-1]["choices"] == []
    # without include_usage there is nothing to make continuous (vLLM's rule)
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in e for e in _events(cluster.url + "/v1/chat/completions", body))
    cluster.all_rpcs_ended()


def test_echo_on_chat_extends_the_last_assistant_message(cluster):  # noqa: F811
    messages = [{"role": "user", "content": "greet"}, {"role": "assistant", "content": "Sure: "}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "add_generation_prompt": False,
            "continue_final_message": True}
    r = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "echo": True}).json()
    assert r["choices"][0]["message"]["content"] == "Sure: Hello"
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == "Hello"
    events = _events(cluster.url + "/v1/chat/completions", {**body, "echo": True, "stream": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Sure: Hello"
    # the last message is the user's: nothing to echo
    r = httpx.post(cluster.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": messages[:1], "max_tokens": 5, "echo": True}).json()
    assert r["choices"][0]["message"]["content"] == "Hello"
    cluster.all_rpcs_ended()


def test_batched_prompts_index_prompt_times_n(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": ["ab", "cde", "fghi"], "n": 2, "max_tokens": 3, "seed": 7}
    r = httpx.post(cluster.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert all(c["text"] == "Hel" for c in out["choices"])
    prompt_tokens = sum(len(TOK.encode(p)) for p in body["prompt"])
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 18,
                            "total_tokens": prompt_tokens + 18, "prompt_tokens_details": {"cached_tokens": 0}}
    requests = cluster.decodes[0].seen.requests[-6:]
    by_prompt = {}
    for req in requests:
        by_prompt.setdefault(tuple(req.token_ids), []).append(req.params.seed)
    assert sorted(map(sorted, by_prompt.values())) == [[7, 8]] * 3  # choice j of each prompt: seed + j
    events = _events(cluster.url + "/v1/completions", {**body, "stream": True})
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i: "Hel" for i in range(6)}
    cluster.all_rpcs_ended()


def test_batched_token_id_prompts(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": [[5, 6], [7, 8, 9]], "max_tokens": 2, "echo": True}
    out = httpx.post(cluster.url + "/v1/completions", json=body).json()
    assert [c["text"] for c in out["choices"]] == [TOK.decode([5, 6]) + "He", TOK.decode([7, 8, 9]) + "He"]
    assert out["usage"]["prompt_tokens"] == 5
    cluster.all_rpcs_ended()


def test_batched_prompt_errors_name_the_prompt(cluster):  # noqa: F811
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": [[1], []]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * 20, "n": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_sampling_fields_reach_both_workers(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_p": 0.25, "allowed_token_ids": [72, 101, 108],
            "bad_words": ["lo"]}
    assert httpx.post(cluster.url + "/v1/completions", json=body).status_code == 200
    for worker in (cluster.prefills[0], cluster.decodes[0]):
        # the fake decode never waits for prefill: the response can come before prefill's call is read
        wait_for(lambda w=worker: w.seen.requests, 5, f"{worker.role} to see the request")
        p = worker.seen.requests[-1].params
        assert p.min_p == 0.25 and list(p.allowed_token_ids) == [72, 101, 108]
        assert [list(s.token_ids) for s in p.bad_words][0] == TOK.encode("lo", add_special_tokens=False)
    cluster.all_rpcs_ended()


def test_return_tokens_as_token_ids(cluster):  # noqa: F811
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    lp = httpx.post(cluster.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in b"Hel"]
    assert all(set(top) == {tok} for top, tok in zip(lp["top_logprobs"], lp["tokens"], strict=True))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True,
            "return_tokens_as_token_ids": True}
    content = httpx.post(cluster.url + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in b"He"]
    assert content[0]["bytes"] == list(f"token_id:{ord('H')}".encode())
    cluster.all_rpcs_ended()


def test_return_token_ids(cluster):  # noqa: F811
    prompt_ids = TOK.encode("xy")
    body = {"model": MODEL, "prompt": "xy", "max_tokens": 4, "return_token_ids": True}
    choice = httpx.post(cluster.url + "/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == list(b"Hell")
    events = _events(cluster.url + "/v1/completions", {**body, "stream": True})
    choices = [e["choices"][0] for e in events]
    assert choices[0]["prompt_token_ids"] == prompt_ids
    assert not any("prompt_token_ids" in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == list(b"Hell")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "return_token_ids": True,
            "stop": ["l"]}
    out = httpx.post(cluster.url + "/v1/chat/completions", json=chat).json()
    assert out["prompt_token_ids"] == TOK.encode_chat(chat["messages"])
    assert out["choices"][0]["token_ids"] == list(b"Hel") and out["choices"][0]["message"]["content"] == "He"
    events = _events(cluster.url + "/v1/chat/completions", {**chat, "stream": True})
    assert events[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == list(b"Hel")
    plain = httpx.post(cluster.url + "/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]
    cluster.all_rpcs_ended()


def test_stop_reason_names_what_stopped_each_choice(cluster):  # noqa: F811
    """vLLM's stop_reason: the stop string, a stop token's id (the client's, or an eos id that is not
    the tokenizer's own), null for the tokenizer's eos and for a length cut."""
    url = cluster.url + "/v1/completions"
    eos, other_eos = TOK.eos_token_ids[:2]

    def reason(decode_script: list[int], route: str = "/v1/completions", **kw) -> tuple[str, object]:
        cluster.decodes[0].script = decode_script
        body = ({"model": MODEL, "prompt": "x", "max_tokens": 10, **kw} if route == "/v1/completions" else
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, **kw})
        choice = httpx.post(cluster.url + route, json=body, timeout=30).json()["choices"][0]
        assert "stop_reason" in choice
        return choice["finish_reason"], choice["stop_reason"]

    hello = list(b"Hello, world! ")
    assert reason(hello, stop=[", w", "!"]) == ("stop", ", w")
    assert reason(hello, stop_token_ids=[ord("o")]) == ("stop", ord("o"))
    assert reason(hello) == ("length", None)
    assert reason([*b"Hi", eos]) == ("stop", None)
    assert reason([*b"Hi", other_eos]) == ("stop", other_eos)
    assert reason(hello, "/v1/chat/completions", stop=["lo"]) == ("stop", "lo")
    assert reason([*b"Hi", eos], "/v1/chat/completions") == ("stop", None)

    # streamed: completions carry it on every chunk (null until the end), chat on the last one
    cluster.decodes[0].script = hello
    events = _events(url, {"model": MODEL, "prompt": "x", "max_tokens": 10, "stop": ["wor"], "stream": True})
    assert [e["choices"][0]["stop_reason"] for e in events] == [None] * (len(events) - 1) + ["wor"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    events = _events(cluster.url + "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
                      "stop_token_ids": [ord(" ")], "stream": True})
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == ord(" ")
    assert all("stop_reason" not in e["choices"][0] for e in events[:-1])
    cluster.all_rpcs_ended()


def test_the_serving_flags_that_set_these_defaults(cluster_factory):  # noqa: F811
    # vLLM's --enable-force-include-usage and --return-tokens-as-token-ids, as router settings
    c = cluster_factory(enable_force_include_usage=True, return_tokens_as_token_ids=True)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    events = _events(c.url + "/v1/completions", body)  # the request asked for no usage
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e.get("usage") is None for e in events[:-1])
    events = _events(c.url + "/v1/completions",
                     {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[0]["usage"]["completion_tokens"] == 1
    whole = httpx.post(c.url + "/v1/completions", json={**body, "stream": False, "logprobs": 1}).json()
    assert whole["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in b"Hel"]
    own = httpx.post(c.url + "/v1/completions", json={**body, "stream": False, "logprobs": 1,
                                                      "return_tokens_as_token_ids": False}).json()
    assert own["choices"][0]["logprobs"]["tokens"] == ["H", "e", "l"]  # the request's own choice wins
    plain = cluster_factory()  # off by default: as before
    events = _events(plain.url + "/v1/completions", body)
    assert all(e.get("usage") is None for e in events)
    c.all_rpcs_ended()
    plain.all_rpcs_ended()
