"""Migration after the first byte, against real processes (1 prefill + 2 decodes, real gRPC and NIXL).

A streamed completion of 1,500 tokens with ignore_eos; after 40 chunks the decode running it is
SIGKILLed (or SIGSTOPped, thawed after the stream ended, the silence meanwhile carrying SSE
keep-alive comments): the client's stream completes with finish_reason "length", no error event,
and exactly the text of an uninterrupted run — greedy,
and with seeded sampling (temperature 0.8). The built-in model's context is 8192 positions,
so prompt + 1,500 fits with room to spare.

Before the first token: a stream whose long prompt is still on prefill has sent its status and a
keep-alive comment (the early start) when its decode is SIGSTOPped; it fails over to the other
decode unseen (no error event, not counted as a migration) with the text of an undisturbed run.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from services.common.tokenizer import load_tokenizer
from tests.integration.mesh import Mesh, mesh_with_router, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# The random test model: the migrated continuation is computed by another path (prefill's one-shot
# forward over prompt + generated ids instead of token-by-token decode), which differs in float
# rounding; its well-separated logits keep 1,500 sampled tokens clear of the near-ties where that
# could flip a token, so the comparison checks migration itself, not rounding luck.
MODEL_FLAGS = ("--model", "builtin-random")
MODEL = "pdmesh-tiny"
TOK = load_tokenizer("builtin-random")
PREFILL_FLAGS = (*MODEL_FLAGS, "--inflight-timeout", "2", "--watchdog-interval", "0.5", "--bootstrap-timeout", "4")
DECODE_FLAGS = (*MODEL_FLAGS, "--watchdog-interval", "0.5", "--heartbeat-interval", "0.5", "--transfer-timeout", "3",
                "--prealloc-timeout", "4")
STALL_TIMEOUT = 2.0
KEEPALIVE = 0.3  # --stream-keepalive-interval: the silence around a frozen decode carries comments
ROUTER_FLAGS = (*MODEL_FLAGS, "--health-check-interval", "0.5", "--health-check-timeout", "0.5",
                "--request-timeout", "120", "--stream-stall-timeout", str(STALL_TIMEOUT),
                "--stream-keepalive-interval", str(KEEPALIVE))
TOKENS = 1500
PROMPT = "Once upon a time, in a mesh far away"


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("router-migration"), 1, 2, PREFILL_FLAGS, DECODE_FLAGS,
                          ROUTER_FLAGS) as (m, (p,), ds, r):
        yield m, p, ds, r


def body(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **kw}


def read_stream(url: str, payload: dict, after: int = 0, fault=None,
                comments: list[float] | None = None) -> tuple[str, list[dict]]:
    """Stream a completion; after `after` chunks call fault() once. Returns (text, events); the
    time of each keep-alive comment since the fault goes into `comments` when given."""
    events: list[dict] = []
    faulted: dict[str, float] = {}
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        with client.stream("POST", url + "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith(":") and comments is not None and "at" in faulted:
                    comments.append(time.monotonic() - faulted["at"])
                if not line or line.startswith(":"):  # a keep-alive comment (SSE): skipped, as clients do
                    continue
                assert line.startswith("data: "), line
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
                if fault is not None and len(events) == after:
                    faulted["at"] = time.monotonic()
                    fault()
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return text, events


def running_decode(r, ds):
    """The decode the router is streaming from (its only request in flight)."""
    status = httpx.get(r.http_url + "/health", timeout=5).json()["decode"]
    busy = [d for d in ds if status[d.grpc_addr]["inflight"] > 0]
    assert len(busy) == 1, status
    return busy[0]


def assert_seamless(text: str, events: list[dict], reference: str) -> None:
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    finals = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == TOKENS
    assert events[-1]["usage"]["prompt_tokens"] == len(TOK.encode(PROMPT))  # the original prompt, not the resubmitted one
    assert len(text) == len(reference) and text == reference


def migrations(r) -> float:
    text = httpx.get(r.http_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdmesh:router_migrations_total{"))


SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234}}


@pytest.fixture(scope="module")
def references(mesh3):
    """reference(sampling): the uninterrupted run through the same router, computed once and only
    when a test asks for it (make test runs the greedy tests alone)."""
    _, _, _, r = mesh3
    out: dict[str, str] = {}

    def reference(sampling: str) -> str:
        if sampling not in out:
            text, events = read_stream(r.http_url, body(**SAMPLINGS[sampling]))
            assert events[-1]["usage"]["completion_tokens"] == TOKENS and len(text) > 0
            out[sampling] = text
        return out[sampling]

    return reference


def revive(m: Mesh, r, proc, ds: list) -> None:
    """Restart a killed decode on its ports and wait until the router admits it again."""
    new = m.restart(proc)
    ds[ds.index(proc)] = new
    wait_for(lambda: httpx.get(r.http_url + "/health", timeout=5).json()["decode"][new.grpc_addr]["healthy"],
             20, "the router to re-admit the restarted decode")


# the seeded run is long-test's (make test's short form: the greedy one)
@pytest.mark.parametrize("sampling", ["greedy", pytest.param("seeded", marks=pytest.mark.long)])
def test_sigkill_mid_stream_migrates_seamlessly(mesh3, references, sampling):
    m, p, ds, r = mesh3
    kw, expected = SAMPLINGS[sampling], references(sampling)  # computed before any fault
    before = migrations(r)
    killed = {}

    def kill():
        killed["proc"] = running_decode(r, ds)
        killed["proc"].kill()

    text, events = read_stream(r.http_url, body(**kw), after=40, fault=kill)
    assert_seamless(text, events, expected)
    assert migrations(r) == before + 1
    revive(m, r, killed["proc"], ds)
    m.assert_invariants()


def test_sigstop_mid_stream_migrates_and_the_frozen_decode_recovers(mesh3, references):
    m, p, ds, r = mesh3
    expected = references("greedy")
    before = migrations(r)
    frozen = {}

    def freeze():
        frozen["proc"] = running_decode(r, ds)
        frozen["proc"].stop()

    t0 = time.monotonic()
    comments: list[float] = []
    try:
        text, events = read_stream(r.http_url, body(temperature=0), after=40, fault=freeze, comments=comments)
    finally:
        if "proc" in frozen:
            frozen["proc"].cont()  # thawed after the stream ended
    elapsed = time.monotonic() - t0
    assert_seamless(text, events, expected)
    assert migrations(r) == before + 1
    assert elapsed < 60, elapsed
    # the client heard keep-alive comments while the frozen decode was given up and the stream moved
    assert comments and comments[0] < 2 * KEEPALIVE + 1, comments
    d = frozen["proc"]
    wait_for(lambda: httpx.get(r.http_url + "/health", timeout=5).json()["decode"][d.grpc_addr]["healthy"],
             20, "the thawed decode to be re-admitted")
    m.assert_invariants(timeout=20)
    # the thawed decode serves again
    resp = httpx.post(r.http_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                      timeout=30)
    assert resp.status_code == 200


def test_sigstop_before_the_first_token_fails_over_unseen_after_the_early_start(mesh3):
    # a long prompt's prefill outlasts the keep-alive interval, so the stream's status and first
    # comment go out before its first token; the decode chosen for it is frozen then, and the
    # request must move to the other decode with nothing for the client to see but more comments
    m, p, ds, r = mesh3
    prompt = "The frozen decode before the first token. " * 150  # ~6,300 byte tokens, never sent before
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    before = migrations(r)
    failovers = r.log().count("attempt failed; failing over")
    frozen = {}
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
            with client.stream("POST", r.http_url + "/v1/completions", json=payload) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith(":") and not frozen and not any(x.startswith("data:") for x in lines):
                        frozen["proc"] = running_decode(r, ds)  # still computing the prompt on prefill
                        frozen["proc"].stop()
                    lines.append(line)
    finally:
        if "proc" in frozen:
            frozen["proc"].cont()
    elapsed = time.monotonic() - t0
    assert frozen, "the first token came before the first keep-alive comment: no early start to test"
    data = [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(x) for x in data[:-1]]
    assert not any("error" in e for e in events), events
    text = "".join(e["choices"][0]["text"] for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert migrations(r) == before  # failed over before its first token, not migrated
    assert r.log().count("attempt failed; failing over") == failovers + 1
    assert STALL_TIMEOUT <= elapsed < 60, elapsed
    # the text the request gets undisturbed (now from the prefix cache: the same greedy tokens)
    whole = httpx.post(r.http_url + "/v1/completions", json={**payload, "stream": False}, timeout=60).json()
    assert text == whole["choices"][0]["text"] and len(text) > 0
    d = frozen["proc"]
    wait_for(lambda: httpx.get(r.http_url + "/health", timeout=5).json()["decode"][d.grpc_addr]["healthy"],
             20, "the thawed decode to be re-admitted")
    m.assert_invariants(timeout=20)
