"""The router in front of real prefill and decode processes: the OpenAI SDK, bad input, disconnects, frozen
and killed workers under load.

- the official openai SDK: completions and chat, streaming and not, usage equal to the real
  token counts (checked against the workers driven directly), `stop` honoured;
- a table of bad inputs: each gets its 4xx OpenAI error, nothing reaches a worker, the router
  keeps serving;
- 24 rounds of a conversation over one keep-alive connection with decode frozen (SIGSTOP)
  during round 8: round 8 errors within the deadline, prefill's inflight queue empties with no
  further traffic, rounds 9–24 succeed on the same connection;
- client disconnect mid-stream: both workers' gauges return to 0 and pages are whole;
- 2 prefill + 2 decode, one of each SIGKILLed under load: requests keep succeeding on the
  survivors and every request ends within its deadline.

Every wait is bounded and polls a condition; every scenario ends with mesh.assert_invariants().
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.fakes.worker_client import generate
from tests.integration.mesh import mesh_with_router, wait_for

pytestmark = pytest.mark.integration

MODEL = "pdmesh-tiny"
TOK = load_tokenizer(None)  # the default model's: models/pdmesh-tiny
# Fast failure detection for the scenarios below (the defaults are minutes).
PREFILL_FLAGS = ("--inflight-timeout", "2", "--watchdog-interval", "0.5", "--bootstrap-timeout", "4")
DECODE_FLAGS = ("--watchdog-interval", "0.5", "--heartbeat-interval", "0.5", "--transfer-timeout", "3",
                "--prealloc-timeout", "4")
# every request through prefill (no conditional disaggregation): rounds repeat their history, and
# these tests count and fault both roles
ROUTER_FLAGS = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5", "--local-prefill-max-tokens", "0")


@pytest.fixture(scope="module")
def basic(tmp_path_factory):
    """One prefill, one decode, one router, shared by the tests that leave them healthy."""
    with mesh_with_router(tmp_path_factory.mktemp("router-basic"), 1, 1, PREFILL_FLAGS, DECODE_FLAGS,
                          (*ROUTER_FLAGS, "--request-timeout", "30")) as (m, (p,), (d,), r):
        yield m, p, d, r


def worker_requests(*procs) -> float:
    return sum(proc.metrics().get("pdmesh:num_requests_total", 0.0) for proc in procs)


def direct(p, d, ids: list[int], params: SamplingParams):
    """The same request straight to the workers over gRPC (no router)."""
    out = asyncio.run(generate(p.grpc_addr, d.grpc_addr, ids, params, timeout=30))
    assert out.ok, (out.prefill_error, out.decode_error)
    return out


# --- openai SDK ------------------------------------------------------------------------------------


def test_openai_sdk(basic):
    openai = pytest.importorskip("openai")
    m, p, d, r = basic
    client = openai.OpenAI(base_url=r.http_url + "/v1", api_key="unused", max_retries=0, timeout=30)

    assert [x.id for x in client.models.list().data] == [MODEL]

    # completions, non-streaming, greedy: equal to the workers driven directly, token for token
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = TOK.encode(prompt)
    ref = direct(p, d, ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.choices[0].text == TOK.decode(ref.tokens)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref.tokens) == 12
    assert out.usage.total_tokens == len(ids) + 12 and out.choices[0].finish_reason == "length"

    # completions, streaming, with usage: the same text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(ids)

    # chat, non-streaming and streaming, seeded sampling: same seed → same reply
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.9, top_p=0.95, seed=42)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    b_chunks = list(b)
    assert b_chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in b_chunks if c.choices)
    assert streamed == a.choices[0].message.content
    chat_ids = TOK.encode_chat(messages)
    assert a.usage.prompt_tokens == len(chat_ids) == b_chunks[-1].usage.prompt_tokens
    assert a.usage.completion_tokens == b_chunks[-1].usage.completion_tokens
    ref = direct(p, d, chat_ids, SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=10,
                                                stop_token_ids=tuple(TOK.eos_token_ids)))
    assert a.usage.completion_tokens == len(ref.tokens)

    # stop: the text ends right before the stop string's first occurrence
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    assert len(stop) == 2
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text

    # logprobs of the chosen tokens
    lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                        extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.content) == 4 and all(t.logprob <= 0 for t in lp.choices[0].logprobs.content)

    m.assert_invariants()


# --- bad inputs ------------------------------------------------------------------------------------


def test_bad_inputs_get_4xx_and_never_reach_a_worker(basic):
    m, p, d, r = basic
    before = worker_requests(p, d)
    ok_chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", b"{this is not json", 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "max_tokens": "four"}).encode(), 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "temperature": [1]}).encode(), 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "max_tokens": -1}).encode(), 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "max_tokens": 10**7}).encode(), 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "messages": []}).encode(), 400),
        ("/v1/chat/completions", json.dumps({**ok_chat, "n": 17}).encode(), 400),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 9000}).encode(), 400),  # > context
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2, 99999]}).encode(), 400),
        ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), 404),
        ("/v1/embeddings", b"{}", 404),
        ("/v1/completions", b'{"model": "pdmesh-tiny", "prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}', 413),
    ]
    with httpx.Client(base_url=r.http_url, timeout=30) as client:
        for path, body, status in cases:
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == status, (path, body[:80], resp.text)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], resp.text
        assert client.post("/v1/chat/completions", json=ok_chat).status_code == 200  # still serving
    assert worker_requests(p, d) == before + 2  # only the last, valid request reached the workers
    m.assert_invariants()


def test_bad_api_key(basic):
    m, p, d, _ = basic
    r = m.start_router([p], [d], *ROUTER_FLAGS, "--api-key", "s3cret")  # a second router, same workers
    try:
        before = worker_requests(p, d)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            resp = httpx.post(r.http_url + "/v1/completions", json=body, headers=headers, timeout=30)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert worker_requests(p, d) == before
        ok = httpx.post(r.http_url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"},
                        timeout=30)
        assert ok.status_code == 200
        m.assert_invariants()
    finally:
        r.kill()


# --- client disconnect --------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_everything(basic):
    m, p, d, r = basic
    aborted = d.metrics().get("pdmesh:num_aborted_requests_total", 0.0)
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", r.http_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(6):  # a few tokens in: decode is mid-generation
                next(lines)
    # the router saw the disconnect and cancelled the Decode RPC; decode aborted the room
    wait_for(lambda: d.metrics().get("pdmesh:num_aborted_requests_total", 0.0) > aborted, 10,
             "decode to abort the room of the disconnected client")
    m.assert_invariants()
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 5, "router in-flight 0")
    assert r.metrics().get('pdmesh:router_requests_total', 0) >= 1


# --- 24 rounds, decode frozen in round 8 ----------------------------------------------------------------


class Conversation:
    """Chat rounds over ONE http.client connection (it never silently reconnects: we check the socket)."""

    def __init__(self, url: str, timeout: float):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.conn.connect()
        self.sock = self.conn.sock
        self.messages: list[dict] = [{"role": "system", "content": "You are a tiny model."}]

    def round(self, n: int, stream: bool) -> tuple[int, str, float]:
        self.messages.append({"role": "user", "content": f"round {n}: say something"})
        body = {"model": MODEL, "messages": self.messages, "max_tokens": 6, "temperature": 0, "stream": stream}
        t0 = time.monotonic()
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = self.conn.getresponse()
        raw = resp.read().decode()
        elapsed = time.monotonic() - t0
        assert self.conn.sock is self.sock, f"round {n}: the keep-alive connection was replaced"
        if resp.status != 200:
            return resp.status, raw, elapsed
        if stream:
            events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e and not e.startswith(":")]
            assert events[-1] == "[DONE]", raw[-300:]
            payloads = [json.loads(e) for e in events[:-1]]
            if "error" in payloads[-1]:
                return 500, raw, elapsed
            text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p.get("choices"))
        else:
            text = json.loads(raw)["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": text})
        return 200, text, elapsed


def test_24_rounds_keepalive_with_decode_frozen_in_round_8(mesh):
    timeout = 6.0
    p = mesh.start_prefill(*PREFILL_FLAGS, "--faults", "delay_forward=0.3", wait=False)
    d = mesh.start_decode(*DECODE_FLAGS, wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    r = mesh.start_router([p], [d], *ROUTER_FLAGS, "--request-timeout", str(timeout))
    conv = Conversation(r.http_url, timeout=timeout + 10)
    for n in range(1, 8):
        status, text, _ = conv.round(n, stream=n % 2 == 0)
        assert status == 200, (n, text)

    # round 8: freeze decode once it has attached (its room waits in the transfer queue while
    # prefill's forward runs), so prefill's KV write goes to a frozen peer
    result: dict = {}
    sent_before = p.metrics().get("pdmesh:kv_transfer_bytes_count", 0)

    def round_8() -> None:
        result["status"], result["body"], result["elapsed"] = conv.round(8, True)

    worker = threading.Thread(target=round_8)
    worker.start()
    try:
        wait_for(lambda: d.metrics().get("pdmesh:num_decode_transfer_queue_reqs", 0) >= 1, 10,
                 "round 8 to attach on decode")
        d.stop()  # SIGSTOP
        worker.join(timeout + 10)
        assert not worker.is_alive(), "round 8 never ended"
        assert result["status"] >= 500, result
        assert result["elapsed"] <= timeout + 1.0, result
        # with no further traffic, prefill's watchdog empties its inflight (and bootstrap) queue
        wait_for(lambda: p.metrics()["pdmesh:num_prefill_inflight_queue_reqs"] == 0
                 and p.metrics()["pdmesh:num_prefill_prealloc_queue_reqs"] == 0, 10,
                 "prefill's inflight queue to empty while decode is frozen")
        sent_round_8 = p.metrics().get("pdmesh:kv_transfer_bytes_count", 0) - sent_before
    finally:
        d.cont()  # SIGCONT
    conv.messages.pop()  # round 8 got no reply

    for n in range(9, 25):
        status, text, _ = conv.round(n, stream=n % 2 == 0)
        assert status == 200, (n, text)
    conv.conn.close()
    mesh.assert_invariants()
    # Prefill let go of round 8's room: by its watchdog, a failed transfer, (since the router
    # ends an attempt the moment it ejects the frozen decode) the cancelled Prefill RPC, or a
    # transfer that completed: a one-sided write into a stopped process's memory over shared
    # memory needs nothing of that process, so a frozen decode can still be written to.
    pm = p.metrics()
    assert pm.get("pdmesh:watchdog_evictions_total{queue=inflight}", 0) >= 1 or \
        pm.get("pdmesh:num_transfer_failed_reqs_total", 0) >= 1 or \
        pm.get("pdmesh:num_aborted_requests_total", 0) >= 1 or sent_round_8 == 1, (sent_round_8, pm)


class ClientLoad:
    """`clients` threads each sending completions back to back (alternately streamed) until
    stopped; `results` holds (start, end, ok, detail) per request. A stream is ok when it carries
    no error event (`data: {"error"`, not generated text "error") and ends with [DONE]."""

    def __init__(self, url: str, max_tokens: int, http_timeout: float, clients: int = 4):
        self.url, self.max_tokens, self.http_timeout = url, max_tokens, http_timeout
        self.lock = threading.Lock()
        self.results: list[tuple[float, float, bool, str]] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=self.http_timeout) as client:
            n = 0
            while not self.stopping.is_set():
                n += 1
                stream = (n + i) % 2 == 0
                body = {"model": MODEL, "prompt": f"client {i} request {n}", "max_tokens": self.max_tokens,
                        "ignore_eos": True, "stream": stream}
                t0 = time.monotonic()
                try:
                    resp = client.post("/v1/completions", json=body)
                    ok = resp.status_code == 200 and (not stream or ('data: {"error"' not in resp.text
                                                                     and resp.text.endswith("data: [DONE]\n\n")))
                    at = resp.text.find('data: {"error"')
                    detail = f"{resp.status_code} {resp.text[max(0, at - 200):at + 600] if at >= 0 else resp.text[-600:]}"
                except httpx.HTTPError as e:
                    ok, detail = False, repr(e)
                with self.lock:
                    self.results.append((t0, time.monotonic(), ok, detail))

    def successes_since(self, t: float) -> int:
        with self.lock:
            return sum(1 for s, _, ok, _ in self.results if ok and s >= t)

    def stop(self, join_timeout: float) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(join_timeout)
        assert not any(t.is_alive() for t in self.threads)


# --- 2P + 2D, kill one of each under load ----------------------------------------------------------------


def test_two_by_two_kill_one_of_each_under_load(mesh):
    timeout = 8.0
    ps = [mesh.start_prefill(*PREFILL_FLAGS, wait=False) for _ in range(2)]
    ds = [mesh.start_decode(*DECODE_FLAGS, wait=False) for _ in range(2)]
    for w in (*ps, *ds):
        mesh.wait_healthy(w)
    r = mesh.start_router(ps, ds, *ROUTER_FLAGS, "--request-timeout", str(timeout))
    load = ClientLoad(r.http_url, max_tokens=12, http_timeout=timeout + 10)
    try:
        wait_for(lambda: load.successes_since(0) >= 8, 60, "load to flow through both pairs")
        t_kill = time.monotonic()
        ps[0].kill()
        ds[0].kill()
        # the router ejects both dead workers (failed request → probe → ejection, or health checks)
        wait_for(lambda: not any(httpx.get(r.http_url + "/health", timeout=5).json()[role][w.grpc_addr]["healthy"]
                                 for role, w in (("prefill", ps[0]), ("decode", ds[0]))),
                 15, "the router to eject the killed workers")
        t_ejected = time.monotonic()
        wait_for(lambda: load.successes_since(t_ejected) >= 12, 60, "requests to keep succeeding on the survivors")
    finally:
        load.stop(timeout + 15)
    results = load.results

    for start, end, _, detail in results:
        assert end - start <= timeout + 2.0, ("a request outlived its deadline", end - start, detail)
    after = [(s, ok, detail) for s, _, ok, detail in results if s >= t_ejected]
    failed_after = [detail for _, ok, detail in after if not ok]
    assert not failed_after, f"requests failed on the survivors: {failed_after[:3]}"
    failed_before = [detail for _, e, ok, detail in results if not ok and e < t_kill]
    assert not failed_before, f"requests failed before the kill: {failed_before[:3]}"
    # A request in flight at the kill, or sent before the router noticed, may fail: a stream
    # that had its first byte ends with an error event, and a retry may land on the other dead
    # worker before it is ejected. Each must end with a clear OpenAI-style error, not hang.
    for _, e, ok, detail in results:
        if not ok and e >= t_kill:
            assert '"error"' in detail and ('"worker_failure"' in detail or '"no_healthy_workers"' in detail), detail
    mesh.assert_invariants()  # the survivors hold nothing for the dead peers


# --- a decode's graceful stop (SIGTERM) under load ---------------------------------------------------------


def test_graceful_stop_of_a_decode_under_load_costs_clients_nothing(mesh):
    """SIGTERM: the decode turns NOT_SERVING and its gRPC server refuses new calls — also the ones
    that arrive on a lane the router already has open (UNAVAILABLE at once, not at the end of the
    stop's grace), so those fail over and the streams it was running migrate: every request
    succeeds, none waits out the grace period, and the survivors' queues and pages end whole."""
    import signal

    p = mesh.start_prefill(*PREFILL_FLAGS, wait=False)
    ds = [mesh.start_decode(*DECODE_FLAGS, wait=False) for _ in range(2)]
    for w in (p, *ds):
        mesh.wait_healthy(w)
    r = mesh.start_router([p], ds, *ROUTER_FLAGS, "--request-timeout", "20")
    load = ClientLoad(r.http_url, max_tokens=24, http_timeout=30)
    try:
        wait_for(lambda: load.successes_since(0) >= 8, 60, "load to flow through both decodes")
        t_term = time.monotonic()
        ds[0].popen.send_signal(signal.SIGTERM)
        ds[0].popen.wait(timeout=30)
        wait_for(lambda: load.successes_since(t_term + 0.5) >= 12, 60, "requests to keep succeeding on the other decode")
    finally:
        load.stop(40)
    results = load.results
    failed = [detail for _, _, ok, detail in results if not ok]
    assert not failed, f"requests failed across the graceful stop: {failed[:3]}"
    started_after = [e - s for s, e, _, _ in results if s >= t_term + 0.5]
    # sent once the stop was under way: refused at once and failed over, never held for the 2 s grace
    assert started_after and max(started_after) < 2.0, max(started_after)
    assert ds[0].popen.returncode == 0, ds[0].log()[-2000:]
    # once stopping, the decode took no new room (the router's calls were refused, not run)
    log = ds[0].log()
    after_stop = log[log.index("decode worker stopping"):]
    assert '"decode request"' not in after_stop, after_stop[:2000]
    mesh.assert_invariants()
