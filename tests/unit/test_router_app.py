"""The router's HTTP app against scripted in-process gRPC workers (services/fakes/workers.py).

Real uvicorn, real gRPC, real sockets; only the workers are fakes, so failures (fail, hang, die,
freeze) are injected exactly where wanted. Every wait is bounded; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable

import grpc
import httpx
import pytest
import uvicorn

from services.common.config import RouterSettings
from services.fakes.workers import Behaviour, FakeDecode, FakePrefill
from services.launch.ports import free_port
from services.router.app import create_app
from services.router.auth import api_keys
from services.router.connection_guard import ConnectionLimits
from services.router.main import server_config

MODEL = "pdmesh-tiny"


def wait_for(cond: Callable[[], object], timeout: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Cluster:
    """Fake workers + the router app on one event loop in a background thread."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, **settings):
        self.prefills = [FakePrefill() for _ in range(n_prefill)]
        self.decodes = [FakeDecode() for _ in range(n_decode)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        # The fake decodes "generate" byte tokens: the byte tokenizer of the random built-in model.
        self._settings = {"model": "builtin-random", "health_check_interval": 0.1, "health_check_timeout": 0.2,
                          **settings}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self._start())

    def call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        for w in (*self.prefills, *self.decodes):
            await w.start()
        settings = RouterSettings(
            prefill=[p.addr for p in self.prefills], decode=[d.addr for d in self.decodes], port=self.port,
            **self._settings,
        )
        self.app = create_app(settings)
        self.router = self.app.state.router
        # the router process's own server: uvicorn with the guarded protocol and its one-write responses
        self.server = uvicorn.Server(server_config(self.app, ConnectionLimits(10.0, 30.0, 4096), host="127.0.0.1",
                                                   port=self.port))
        self.serve_task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self.serve_task.done():
                self.serve_task.result()
            await asyncio.sleep(0.01)
        # the first probes time out after health_check_timeout (0.2 s), which a loaded machine can
        # exceed: then the health loop admits the worker moments later. Tests pick their workers
        # by round robin, so they start once every worker is in (a worker a test keeps out stays
        # out; this wait then just ends)
        give_up = self.loop.time() + 5
        while not all(w.healthy for w in self.router.pool.workers) and self.loop.time() < give_up:
            await asyncio.sleep(0.01)

    async def _stop(self):
        self.server.should_exit = True
        await asyncio.wait_for(self.serve_task, 10)
        for w in (*self.prefills, *self.decodes):
            await w.stop()

    def close(self):
        try:
            self.call(self._stop(), timeout=15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)

    # --- assertions ------------------------------------------------------------------------------

    def all_rpcs_ended(self, timeout: float = 5.0) -> None:
        """Every fake's RPCs have finished and the router holds nothing in flight."""
        workers = [*self.prefills, *self.decodes]
        wait_for(
            lambda: all(w.seen.active == 0 for w in workers)
            and self.router.active == 0
            and all(w.inflight == 0 for w in self.router.pool.workers)
            # every lease taken was released (services/router/leases.py)
            and self.router.admission.ledger.outstanding == 0
            and self.router.pool.leases.outstanding == 0,
            timeout,
            f"all RPCs to end: {[(w.role, w.seen.active) for w in workers]}, router active {self.router.active}",
        )

    def total_rooms(self) -> int:
        return sum(len(w.seen.rooms) for w in (*self.prefills, *self.decodes))

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture
def cluster_factory():
    made = []

    def make(**kw) -> Cluster:
        c = Cluster(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(cluster_factory) -> Cluster:
    return cluster_factory()


def post(c: Cluster, path: str, body, **kw) -> httpx.Response:
    return httpx.post(c.url + path, json=body, timeout=10, **kw)


def completion(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 5, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}


def sse_payloads(text: str) -> list:
    """Parse an SSE body strictly: only `data:` events separated by blank lines, ending with [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    out = []
    for ev in events:
        assert ev.startswith("data: "), ev
        data = ev[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


# --- the happy paths -----------------------------------------------------------------------------


def test_completion_json(cluster):
    r = post(cluster, "/v1/completions", completion())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # the fake decode never waits for prefill: the response can come before prefill's call is read
    wait_for(lambda: cluster.prefills[0].seen.requests, what="prefill to see the request")
    p, d = cluster.prefills[0].seen.requests[0], cluster.decodes[0].seen.requests[0]
    assert p.room == d.room and d.prefill_addr == cluster.prefills[0].addr
    assert p.params.HasField("seed") and p.params.seed == d.params.seed  # a seed is always sent
    assert list(p.token_ids) == list(d.token_ids)
    cluster.all_rpcs_ended()


def test_chat_stream_with_usage(cluster):
    r = post(cluster, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "Hello"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert len({e["id"] for e in events}) == 1
    cluster.all_rpcs_ended()


def test_completion_stream_without_usage(cluster):
    r = post(cluster, "/v1/completions", completion(stream=True))
    events = sse_payloads(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello"
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_is_trimmed_and_decode_cancelled(cluster):
    d = cluster.decodes[0]
    d.behaviour = Behaviour(token_delay=0.02)
    r = post(cluster, "/v1/completions", completion(max_tokens=200, stop=["lo, w"]))
    assert r.json()["choices"][0]["text"] == "Hel" and r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 8
    cluster.all_rpcs_ended()
    assert d.seen.cancelled == 1  # the Decode RPC was cancelled, not run to max_tokens
    r = post(cluster, "/v1/chat/completions", chat(max_tokens=200, stop="o, w", stream=True))
    events = sse_payloads(r.text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hell"
    cluster.all_rpcs_ended()
    assert d.seen.cancelled == 2


def test_stop_token_is_counted_not_shown(cluster):
    r = post(cluster, "/v1/completions", completion(max_tokens=50, stop_token_ids=[ord(",")]))
    body = r.json()
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 6
    sent = cluster.decodes[0].seen.requests[0].params
    assert ord(",") in sent.stop_token_ids and 258 in sent.stop_token_ids  # client's ids + eos


def test_logprobs(cluster):
    r = post(cluster, "/v1/chat/completions", chat(logprobs=True, top_logprobs=1))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list("Hello") and all(c["logprob"] == -0.5 for c in content)
    r = post(cluster, "/v1/completions", completion(logprobs=0, stream=True))
    events = sse_payloads(r.text)
    assert sum(len(e["choices"][0]["logprobs"]["token_logprobs"]) for e in events) == 5


def test_models_health_metrics(cluster):
    models = httpx.get(cluster.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert httpx.get(cluster.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.get(cluster.url + "/v1/models/nope").status_code == 404
    health = httpx.get(cluster.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    post(cluster, "/v1/completions", completion())
    text = httpx.get(cluster.url + "/metrics").text
    for name in ("pdmesh:router_requests_total", "pdmesh:router_time_to_first_token_seconds",
                 "pdmesh:router_inter_token_latency_seconds", "pdmesh:router_e2e_request_latency_seconds",
                 "pdmesh:router_num_running_reqs", "pdmesh:worker_healthy"):
        assert name in text, name
    assert cluster.metric("pdmesh:router_requests_total", status="200") >= 1
    assert cluster.metric("pdmesh:worker_healthy", engine_type="router") == 2


# --- bad input ------------------------------------------------------------------------------------


def raw_post(c: Cluster, path: str, data: bytes, headers=None) -> httpx.Response:
    return httpx.post(c.url + path, content=data, headers={"content-type": "application/json", **(headers or {})},
                      timeout=10)


@pytest.mark.parametrize(
    "path,data,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", b"[1,2]", 400, None),
        ("/v1/completions", json.dumps(completion(max_tokens="5")).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(max_tokens=-3)).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(max_tokens=10**9)).encode(), 400, "max_tokens"),
        ("/v1/completions", json.dumps(completion(prompt="x" * 9000)).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps(completion(n=17)).encode(), 400, "n"),
        ("/v1/completions", json.dumps(completion(model="other")).encode(), 404, "model"),
        ("/v1/chat/completions", json.dumps(chat(messages=[])).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps(chat(temperature="hot")).encode(), 400, "temperature"),
        ("/v1/chat/completions", b'{"model": "pdmesh-tiny", "messages": [{"role": "user", "content": "hi"}], '
                                 b'"temperature": NaN}', 400, "temperature"),
        ("/v1/nothing", b"{}", 404, None),
    ],
)
def test_bad_inputs_never_reach_a_worker(cluster, path, data, status, param):
    r = raw_post(cluster, path, data)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert cluster.total_rooms() == 0
    assert post(cluster, "/v1/completions", completion()).status_code == 200  # still serving


def test_a_compressed_body_is_named_as_the_problem(cluster):
    body = gzip.compress(json.dumps(completion()).encode())
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = raw_post(cluster, path, body, {"content-encoding": "gzip"})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_content_encoding" and "gzip" in r.json()["error"]["message"]
    assert raw_post(cluster, "/v1/completions", body).status_code == 400  # without the header: not JSON
    assert cluster.total_rooms() == 0
    # a body that parses is served
    assert raw_post(cluster, "/v1/completions", json.dumps(completion()).encode(),
                    {"content-encoding": "identity"}).status_code == 200


def test_method_not_allowed_is_an_openai_error(cluster):
    r = httpx.get(cluster.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_body_limit_checked_before_parsing(cluster_factory):
    c = cluster_factory(max_body_bytes=1000)
    big = b'{"model": "' + b"x" * 2000 + b'"}'
    r = raw_post(c, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while reading
        yield b"{" + b" " * 600
        yield b" " * 600 + b"}"

    r = httpx.post(c.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert c.total_rooms() == 0
    assert post(c, "/v1/completions", completion()).status_code == 200


def test_api_key(cluster_factory):
    c = cluster_factory(api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = post(c, "/v1/completions", completion(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(c.url + "/v1/models").status_code == 401
    assert post(c, "/v1/completions", completion(), headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert httpx.get(c.url + "/health").status_code == 200  # probes need no key
    assert c.total_rooms() == 2


def test_several_api_keys_any_of_them(cluster_factory):
    # a rotation: the old key and the new one both work until the old one is dropped
    c = cluster_factory(api_key="new-key,old-key")
    for key in ("new-key", "old-key"):
        r = post(c, "/v1/completions", completion(), headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
    for headers in ({}, {"Authorization": "Bearer new-key,old-key"}, {"Authorization": "Bearer other"}):
        assert post(c, "/v1/completions", completion(), headers=headers).status_code == 401
    # the JSON-list form, and a setting given as a list in code
    assert api_keys('["a", "b,c"]') == ["a", "b,c"] and api_keys(["a", "b,c"]) == ["a", "b", "c"]
    assert api_keys("") == [] and api_keys(" a , b ") == ["a", "b"]


def test_concurrency_limit_is_429(cluster_factory):
    c = cluster_factory(max_concurrent_requests=1)
    c.decodes[0].behaviour = Behaviour(delay=3)  # holds the one slot while the second request arrives, even on a loaded machine
    with httpx.Client(timeout=10) as client:
        slow = threading.Thread(target=lambda: client.post(c.url + "/v1/completions", json=completion()))
        slow.start()
        wait_for(lambda: c.router.active == 1, what="the first request to be admitted")
        r = httpx.post(c.url + "/v1/completions", json=completion(), timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        slow.join(10)
    assert post(c, "/v1/completions", completion()).status_code == 200
    c.all_rpcs_ended()


# --- failures and retries ---------------------------------------------------------------------------


def test_decode_failure_before_first_token_is_retried_on_another_pair(cluster_factory):
    c = cluster_factory(n_prefill=2, n_decode=2)
    d0, d1 = c.decodes  # round-robin starts with the first of each
    d0.behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INTERNAL)
    c.prefills[0].behaviour = Behaviour(delay=5)  # still computing when decode fails
    r = post(c, "/v1/completions", completion())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"
    assert len(d0.seen.rooms) == 1 and len(d1.seen.rooms) == 1  # the retry went to the other decode
    p0, p1 = c.prefills
    assert len(p0.seen.rooms) == 1 and len(p1.seen.rooms) == 1  # and to the other prefill
    assert d0.seen.rooms[0] != d1.seen.rooms[0]  # with a fresh room
    c.all_rpcs_ended()
    assert p0.seen.cancelled == 1  # the failed attempt's Prefill RPC was cancelled


def test_prefill_failure_cancels_decode_then_503_after_one_retry(cluster):
    cluster.prefills[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INTERNAL)
    cluster.decodes[0].behaviour = Behaviour(delay=5)  # decode would wait for the KV
    t0 = time.monotonic()
    r = post(cluster, "/v1/completions", completion())
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_failure"
    assert time.monotonic() - t0 < 3
    assert len(cluster.prefills[0].seen.rooms) == 2  # one retry (same pair: there is no other)
    cluster.all_rpcs_ended()
    # both calls go out at once; on a loaded machine the prefill's failure can come back before a
    # decode call has reached the worker, and the router then drops it unsent. Each one that did
    # reach it was cancelled: none waited out its KV
    decode = cluster.decodes[0].seen
    assert decode.cancelled == len(decode.rooms) <= 2


def test_invalid_argument_from_worker_is_400_without_retry(cluster):
    cluster.decodes[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INVALID_ARGUMENT)
    r = post(cluster, "/v1/completions", completion())
    assert r.status_code == 400
    assert len(cluster.decodes[0].seen.rooms) == 1


class StreamThatFails:
    """A stream on `path` whose decode fails after 3 tokens, with migration off (it would move the
    request instead), on a keep-alive connection: `text` is what the client read, `again(body)`
    the JSON of a second request sent on the same connection, which must be the same socket."""

    def __init__(self, cluster_factory, path: str, body: dict):
        self.cluster = cluster_factory(max_migrations=0)
        self.cluster.decodes[0].behaviour = Behaviour(mode="fail_after", after=3, times=1)
        self.path = path
        self.conn = http.client.HTTPConnection("127.0.0.1", self.cluster.port, timeout=10)
        self.conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = self.conn.getresponse()
        self.text = resp.read().decode()
        self.sock = self.conn.sock
        assert resp.status == 200

    def again(self, body: dict) -> dict:
        self.conn.request("POST", self.path, json.dumps(body), {"content-type": "application/json"})
        resp = self.conn.getresponse()
        assert resp.status == 200
        out = json.loads(resp.read())
        assert self.conn.sock is self.sock  # the same keep-alive connection
        self.conn.close()
        self.cluster.all_rpcs_ended()
        return out


def test_failure_after_first_byte_ends_stream_with_error_and_keeps_connection(cluster_factory):
    s = StreamThatFails(cluster_factory, "/v1/completions", completion(stream=True, max_tokens=20))
    cluster = s.cluster
    events = sse_payloads(s.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hel"
    assert events[-1]["error"]["code"] == "worker_failure"
    assert s.again(completion())["choices"][0]["text"] == "Hello"
    assert len(cluster.decodes[0].seen.rooms) == 2  # no retry after the first byte


def test_deadline_is_504_and_cancels_both(cluster_factory):
    c = cluster_factory(request_timeout=0.6)
    c.decodes[0].behaviour = Behaviour(mode="hang")
    c.prefills[0].behaviour = Behaviour(mode="hang")
    t0 = time.monotonic()
    r = post(c, "/v1/chat/completions", chat(stream=True))
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 2
    c.all_rpcs_ended()


def test_deadline_mid_stream_is_an_error_event(cluster_factory):
    c = cluster_factory(request_timeout=0.6)
    c.decodes[0].behaviour = Behaviour(mode="hang_after", after=2)
    r = post(c, "/v1/completions", completion(stream=True, max_tokens=20))
    events = sse_payloads(r.text)
    assert events[-1]["error"]["code"] == "timeout"
    c.all_rpcs_ended()


def test_client_disconnect_mid_stream_cancels_both(cluster):
    d = cluster.decodes[0]
    d.behaviour = Behaviour(token_delay=0.05)
    cluster.prefills[0].behaviour = Behaviour(mode="hang")  # prefill's reply never comes: must be cancelled
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", cluster.url + "/v1/completions", json=completion(stream=True, max_tokens=1000)) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert got[0].startswith("data: ")
    cluster.all_rpcs_ended()
    assert d.seen.cancelled == 1 and cluster.prefills[0].seen.cancelled == 1
    assert cluster.metric("pdmesh:router_requests_total", status="499") == 1


def test_client_disconnect_while_waiting_for_first_token(cluster):
    cluster.decodes[0].behaviour = Behaviour(mode="hang")
    cluster.prefills[0].behaviour = Behaviour(mode="hang")
    with socket.create_connection(("127.0.0.1", cluster.port)) as s:
        body = json.dumps(completion()).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: cluster.decodes[0].seen.active == 1 and cluster.prefills[0].seen.active == 1,
                 what="both RPCs to start")
    cluster.all_rpcs_ended()
    assert cluster.decodes[0].seen.cancelled == 1 and cluster.prefills[0].seen.cancelled == 1


# --- health ----------------------------------------------------------------------------------------


def test_unhealthy_worker_is_ejected_and_readmitted(cluster_factory):
    c = cluster_factory(n_decode=2)
    d0, d1 = c.decodes
    d0.set_serving(False)
    wait_for(lambda: not c.router.pool.decodes[0].healthy, what="d0 ejected")
    assert c.metric("pdmesh:worker_healthy", target=d0.addr) == 0
    for _ in range(4):
        assert post(c, "/v1/completions", completion()).status_code == 200
    assert len(d0.seen.rooms) == 0 and len(d1.seen.rooms) == 4
    d0.set_serving(True)
    wait_for(lambda: c.router.pool.decodes[0].healthy, what="d0 re-admitted")
    for _ in range(4):
        post(c, "/v1/completions", completion())
    assert len(d0.seen.rooms) == 2


def test_frozen_worker_is_ejected(cluster_factory):
    c = cluster_factory(n_decode=2)
    c.decodes[0].health.frozen = True
    wait_for(lambda: not c.router.pool.decodes[0].healthy, what="the frozen decode ejected")
    c.decodes[0].health.frozen = False


def test_no_healthy_decode_is_503_and_health_reports_it(cluster_factory):
    # probes may take 2 s: the on-the-spot probe below must not time out on a loaded machine
    cluster = cluster_factory(health_check_timeout=2.0)
    cluster.decodes[0].set_serving(False)
    wait_for(lambda: httpx.get(cluster.url + "/health").status_code == 503, what="/health 503")
    r = post(cluster, "/v1/completions", completion())
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_workers"
    cluster.decodes[0].set_serving(True)
    # no wait for the periodic probe: a request that finds no healthy decode probes on the spot
    assert post(cluster, "/v1/completions", completion()).status_code == 200


def test_dead_worker_leaves_rotation_at_once(cluster_factory):
    c = cluster_factory(n_decode=2, health_check_interval=30)  # only the request-triggered probe can act
    c.call(c.decodes[0].stop())
    codes = [post(c, "/v1/completions", completion()).status_code for _ in range(6)]
    assert codes == [200] * 6  # a failure before the first byte is retried on the other decode
    wait_for(lambda: not c.router.pool.decodes[0].healthy, what="the dead decode ejected")


def test_least_loaded_spreads_concurrent_requests(cluster_factory):
    c = cluster_factory(n_prefill=2, n_decode=2, policy="least_loaded")
    for w in (*c.prefills, *c.decodes):
        w.behaviour = Behaviour(delay=0.3)
    with httpx.Client(timeout=10) as client:
        threads = [threading.Thread(target=lambda: client.post(c.url + "/v1/completions", json=completion()))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert [len(d.seen.rooms) for d in c.decodes] == [2, 2]
    assert [len(p.seen.rooms) for p in c.prefills] == [2, 2]


def test_openai_sdk_against_fakes(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert out.choices[0].text == "Hello" and out.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello"
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5, n=17)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # failing after every 2 tokens: the request migrates twice (--max-migrations), then gives up
    cluster.decodes[0].behaviour = Behaviour(mode="fail_after", after=2)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True))
