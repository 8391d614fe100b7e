"""Fail-over before the first byte and migration after it, against scripted gRPC workers.

The fake decodes run in `positional` mode: the token at absolute position p is script[p % len],
as the real workers' (seed, position)-keyed sampling makes it, so a request re-submitted with
prompt + generated ids continues the same sequence and the expected text is known exactly.
"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from services.common.builtin_tokenizer import BuiltinTokenizer
from services.common.refusal import Refusal
from services.fakes.workers import Behaviour
from tests.unit.test_router_app import MODEL, Cluster, chat, completion, post, sse_payloads, wait_for

pytestmark = pytest.mark.timeout(60)

PROMPT = "hi"
PROMPT_LEN = len(BuiltinTokenizer().encode(PROMPT))  # what the fake decode sees (bos included)

# what next() waits on differs by carrier: the lane's own read future, or a task per read (one RPC
# per call, --worker-lane false); a stall or an ejection must end the wait on both
CARRIERS = pytest.mark.parametrize("lane", [True, False], ids=["lane", "rpc"])


@pytest.fixture
def make():
    made: list[Cluster] = []

    def factory(**kw) -> Cluster:
        c = Cluster(**kw)
        for d in c.decodes:
            d.positional = True
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


def expected(c: Cluster, n: int, prompt_len: int = PROMPT_LEN) -> str:
    script = c.decodes[0].script
    return bytes(script[(prompt_len + i) % len(script)] for i in range(n)).decode()


def stream_text(c: Cluster, **kw) -> tuple[str, list]:
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, **kw))
    assert r.status_code == 200, r.text
    events = sse_payloads(r.text)
    assert not any("error" in e for e in events), events[-1]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


# --- migration after the first byte ----------------------------------------------------------------


def test_streamed_request_migrates_when_its_decode_fails(make):
    c = make(n_decode=2)
    d0, d1 = c.decodes
    d0.behaviour = Behaviour(mode="fail_after", after=3, code=grpc.StatusCode.UNAVAILABLE)
    text, events = stream_text(c, max_tokens=12, seed=7, logprobs=0, stream_options={"include_usage": True})
    assert text == expected(c, 12)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": PROMPT_LEN, "completion_tokens": 12,
                                   "total_tokens": PROMPT_LEN + 12, "prompt_tokens_details": {"cached_tokens": 0}}
    lps = [lp for e in events if e.get("choices") and e["choices"][0]["logprobs"]
           for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(lps) == 12  # logprobs continue across the move
    moved = d1.seen.requests[0]
    first = d0.seen.requests[0]
    script = c.decodes[0].script
    assert list(moved.token_ids) == [*first.token_ids, *(script[(PROMPT_LEN + i) % len(script)] for i in range(3))]
    assert moved.params.max_tokens == 9 and moved.params.seed == first.params.seed == 7
    # prefill recomputes prompt + generated (its call may be read after the response: the fake decode never waits)
    wait_for(lambda: len(c.prefills[0].seen.requests) == 2, 5, "prefill to see the moved request")
    assert c.prefills[0].seen.requests[-1].token_ids == moved.token_ids
    c.all_rpcs_ended()
    assert c.metric("pdmesh:router_migrations_total", reason="decode_failed") == 1
    assert c.metric("pdmesh:router_requests_total", status="200") == 1


def test_non_streamed_request_migrates(make):
    c = make(n_decode=2)
    c.decodes[0].behaviour = Behaviour(mode="fail_after", after=4, code=grpc.StatusCode.INTERNAL)
    r = post(c, "/v1/completions", completion(prompt=PROMPT, max_tokens=10))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == expected(c, 10) and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == PROMPT_LEN and body["usage"]["completion_tokens"] == 10
    c.all_rpcs_ended()


def test_stop_string_spanning_the_migration_point(make):
    c = make(n_decode=2)
    full = expected(c, 12)
    stop = full[2:5]  # "lo," with the default script: the match straddles token 3 (the move)
    c.decodes[0].behaviour = Behaviour(mode="fail_after", after=3)
    text, events = stream_text(c, max_tokens=12, stop=[stop])
    assert text == full[: full.index(stop)] and events[-1]["choices"][0]["finish_reason"] == "stop"
    c.all_rpcs_ended()


@CARRIERS
def test_silent_decode_mid_stream_is_a_stall_and_migrates(make, lane):
    c = make(n_decode=2, stream_stall_timeout=0.4, health_check_interval=30, worker_lane=lane)  # only the stall rule can act
    c.decodes[0].behaviour = Behaviour(mode="hang_after", after=3)
    t0 = time.monotonic()
    text, _ = stream_text(c, max_tokens=8)
    assert text == expected(c, 8) and time.monotonic() - t0 < 3
    c.all_rpcs_ended()
    assert c.decodes[0].seen.cancelled == 1  # the stalled stream was cancelled: decode aborts the room
    assert c.metric("pdmesh:router_migrations_total", reason="decode_stalled") == 1


@CARRIERS
def test_ejected_decode_mid_stream_migrates_at_once(make, lane):
    c = make(n_decode=2, stream_stall_timeout=30, worker_lane=lane)
    d0 = c.decodes[0]
    d0.behaviour = Behaviour(mode="hang_after", after=3)
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", c.url + "/v1/completions",
                           json=completion(prompt=PROMPT, stream=True, max_tokens=8)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            wait_for(lambda: d0.seen.active == 1 and len(d0.seen.rooms) == 1, what="d0 streaming")
            t0 = time.monotonic()
            d0.set_serving(False)  # the pool ejects it; the attempt hears of it at once
            body = "\n".join([*lines])
    assert time.monotonic() - t0 < 3
    assert '"error"' not in body and body.strip().endswith("data: [DONE]")
    c.all_rpcs_ended()
    assert c.metric("pdmesh:router_migrations_total", reason="decode_ejected") == 1


def test_migrations_are_bounded(make):
    c = make(n_decode=2, max_migrations=1)
    for d in c.decodes:
        d.behaviour = Behaviour(mode="fail_after", after=2)
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=20))
    events = sse_payloads(r.text)
    assert events[-1]["error"]["code"] == "worker_failure"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected(c, 4)
    c.all_rpcs_ended()
    assert c.metric("pdmesh:router_migrations_total") == 1


# --- fail-over before the first byte ----------------------------------------------------------------


@CARRIERS
def test_ejected_decode_before_first_token_fails_over_at_once(make, lane):
    c = make(n_decode=2, stream_stall_timeout=30, worker_lane=lane)
    d0, d1 = c.decodes
    d0.behaviour = Behaviour(mode="hang")
    t0 = time.monotonic()
    box = {}
    import threading

    th = threading.Thread(target=lambda: box.setdefault("r", post(c, "/v1/completions", completion(prompt=PROMPT))))
    th.start()
    wait_for(lambda: d0.seen.active == 1, what="d0 holds the request")
    d0.set_serving(False)
    th.join(10)
    assert box["r"].status_code == 200 and box["r"].json()["choices"][0]["text"] == expected(c, 5)
    assert time.monotonic() - t0 < 3 and len(d1.seen.rooms) == 1
    c.all_rpcs_ended()


@CARRIERS
def test_silent_decode_before_first_token_fails_over(make, lane):
    c = make(n_decode=2, stream_stall_timeout=0.4, health_check_interval=30, worker_lane=lane)
    c.decodes[0].behaviour = Behaviour(mode="hang")
    t0 = time.monotonic()
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 200 and time.monotonic() - t0 < 3
    c.all_rpcs_ended()
    assert c.decodes[0].seen.cancelled == 1


def test_keepalive_chunks_are_not_silence(make):
    c = make(stream_stall_timeout=0.3)
    c.decodes[0].behaviour = Behaviour(delay=1.2, keepalive=0.1)  # waiting (e.g. for KV) 4x the stall timeout
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(c, 5)
    assert len(c.decodes[0].seen.rooms) == 1  # no fail-over
    c.all_rpcs_ended()


def test_only_decode_ejected_is_503_at_once(make):
    c = make(stream_stall_timeout=30, request_timeout=30)
    d = c.decodes[0]
    d.behaviour = Behaviour(mode="hang")
    import threading

    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", post(c, "/v1/completions", completion(prompt=PROMPT))))
    th.start()
    wait_for(lambda: d.seen.active == 1, what="decode holds the request")
    t0 = time.monotonic()
    d.health.frozen = True  # probes time out: ejected after the threshold
    th.join(10)
    r = box["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers", r.text
    assert time.monotonic() - t0 < 2
    d.health.frozen = False
    d.behaviour = Behaviour()
    assert post(c, "/v1/completions", completion(prompt=PROMPT)).status_code == 200  # probed on the spot
    c.all_rpcs_ended()


# --- capacity refusals -----------------------------------------------------------------------------

# a capacity refusal is known by its code, whatever its words (services/common/refusal.py)
CAPACITY = dict(mode="fail", code=grpc.StatusCode.INVALID_ARGUMENT, refusal=Refusal.KV_CAPACITY,
                details="this worker's pool is too small")


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "one_rpc_per_call"])
def test_capacity_refusal_is_retried_on_another_decode(make, lane):
    c = make(n_decode=2, worker_lane=lane)  # the code travels in LaneEnd, or in the RPC's trailing metadata
    c.decodes[0].behaviour = Behaviour(**CAPACITY)
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 200 and len(c.decodes[1].seen.rooms) == 1
    c.all_rpcs_ended()


def test_too_long_for_one_worker_is_retried_on_another_decode(make):
    c = make(n_decode=2)
    c.decodes[0].behaviour = Behaviour(**{**CAPACITY, "refusal": Refusal.TOO_LONG})
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 200 and len(c.decodes[1].seen.rooms) == 1
    c.all_rpcs_ended()


def test_the_capacity_sentence_without_its_code_is_a_400_at_once(make):
    c = make(n_decode=2)
    c.decodes[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INVALID_ARGUMENT,
                                       details="prompt of 3 tokens needs more KV pages than this worker has")
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    assert [len(d.seen.rooms) for d in c.decodes] == [1, 0]
    c.all_rpcs_ended()


def test_capacity_refusal_everywhere_is_400(make):
    c = make(n_decode=2)
    for d in c.decodes:
        d.behaviour = Behaviour(**CAPACITY)
    r = post(c, "/v1/completions", completion(prompt=PROMPT))
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_capacity_exceeded", r.text
    assert [len(d.seen.rooms) for d in c.decodes] == [1, 1]
    c.all_rpcs_ended()


# --- smaller contracts ------------------------------------------------------------------------------


def test_429_comes_before_the_body_is_read(make):
    import threading

    c = make(max_concurrent_requests=1)
    c.decodes[0].behaviour = Behaviour(delay=0.5)
    th = threading.Thread(target=lambda: post(c, "/v1/completions", completion()))
    th.start()
    wait_for(lambda: c.router.active == 1, what="the first request to be admitted")
    r = httpx.post(c.url + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    th.join(10)
    c.all_rpcs_ended()


def test_stop_strings_have_a_length_cap(make):
    c = make()
    r = post(c, "/v1/completions", completion(stop=["x" * 257]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert post(c, "/v1/completions", completion(stop=["x" * 256])).status_code == 200


def test_openapi_describes_the_openai_endpoints(make):
    c = make()
    schema = httpx.get(c.url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert model in schema["components"]["schemas"]
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["required"]
    assert {"/v1/models", "/health"} <= set(schema["paths"])
    ids = [op["operationId"] for methods in schema["paths"].values() for op in methods.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)  # client generators need them unique
    assert set(schema["paths"]["/ping"]) == {"get", "post"}
    docs = httpx.get(c.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert MODEL  # the served name the schema's examples refer to
    invocations = schema["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(invocations["oneOf"]) == 2


def test_docs_can_be_switched_off(make):
    # vLLM's --disable-fastapi-docs: neither the schema nor the Swagger UI, the API as before
    c = make(disable_fastapi_docs=True)
    for path in ("/openapi.json", "/docs"):
        r = httpx.get(c.url + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url", path
    assert post(c, "/v1/completions", completion()).status_code == 200


# --- n > 1: one prefill for all choices --------------------------------------------------------------


def _choices(c: Cluster, n: int) -> list[str]:
    r = post(c, "/v1/completions", completion(prompt=PROMPT, max_tokens=5, seed=3, n=n))
    assert r.status_code == 200, r.text
    return [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]


def test_n_choices_share_one_prefill_and_one_key_while_decodes_differ(make):
    c = make(n_prefill=2, n_decode=2)
    assert _choices(c, 4) == [expected(c, 5)] * 4
    used = [p for p in c.prefills if p.seen.requests]
    assert len(used) == 1 and len(used[0].seen.requests) == 4
    keys = {r.share_key for r in used[0].seen.requests}
    assert len(keys) == 1 and keys != {0}
    assert all(d.seen.requests for d in c.decodes)  # decode is chosen per choice as usual
    # the fake decode answers without waiting for the KV, so a Prefill call may still be on its
    # way to its worker when the response is in: the calls are counted once every one has ended
    _choices(c, 4)
    c.all_rpcs_ended()
    assert len({r.share_key for p in c.prefills for r in p.seen.requests}) == 2  # a key per request
    _choices(c, 1)
    c.all_rpcs_ended()
    assert [r.share_key for p in c.prefills for r in p.seen.requests].count(0) == 1  # n = 1: no key


def test_a_choice_that_fails_over_retries_without_the_key(make):
    c = make(n_prefill=2, n_decode=1)
    for p in c.prefills:  # whichever prefill the choices share fails its first Prefill once
        p.behaviour = Behaviour(mode="fail", times=1, code=grpc.StatusCode.UNAVAILABLE)
    # the fake decode streams without waiting for any KV: held back, its first token cannot beat
    # the Prefill failure (after the first token a prefill failure no longer matters)
    c.decodes[0].behaviour = Behaviour(delay=0.3)
    assert _choices(c, 3) == [expected(c, 5)] * 3
    keyed = [(p, r.share_key) for p in c.prefills for r in p.seen.requests if r.share_key]
    assert len(keyed) == 3 and len(set(keyed)) == 1  # the first attempts: one prefill, one key
    retries = [r for p in c.prefills for r in p.seen.requests if not r.share_key]
    assert retries  # the failed choice's retry is an ordinary request
    c.all_rpcs_ended()


def test_served_under_a_proxy_path_prefix(make):
    # vLLM's --root-path: a proxy that passes /llm on and one that strips it both reach the API,
    # and the schema names /llm as its server so /docs calls through the proxy
    c = make(root_path="/llm")
    for prefix in ("/llm", ""):
        assert post(c, prefix + "/v1/completions", completion()).status_code == 200, prefix
        assert post(c, prefix + "/v1/chat/completions", chat()).status_code == 200, prefix
        assert httpx.get(c.url + prefix + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(c.url + "/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
    assert "/llm/openapi.json" in httpx.get(c.url + "/llm/docs").text
    assert httpx.post(c.url + "/llmx/v1/completions", json=completion()).status_code == 404
    c.all_rpcs_ended()
