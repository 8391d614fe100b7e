"""Conditional disaggregation through the real mesh (1 prefill + 1 decode, real gRPC, HTTP and
NIXL; services/router/conditional_disagg.py): a multi-round conversation (token-id prompts,
greedy) through a router with --local-prefill-max-tokens 64. Round 1 goes PD (nothing is cached
yet); a later round whose uncached part is short goes to decode alone: prefill serves no
request and moves no KV, decode reports cached tokens, the router counts it and logs
path="local"; a round that adds more than the threshold goes PD again. The same conversation
through a second router on the same workers with the rule off (--local-prefill-max-tokens 0),
after POST /reset_prefix_cache, must produce identical text round by round. Ends with
mesh.assert_invariants()."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import Mesh, wait_for

pytestmark = pytest.mark.integration

THRESHOLD = 64
REPLY = 8  # max_tokens per round
FIRST = 90  # round 1's prompt
# new tokens each later round adds beyond the previous prompt and reply: each short one leaves at
# most new + 1 + a partial page (15) uncached on decode, within the threshold; 100 is beyond it
NEW = [40, 40, 100, 40]
LOCAL = [False, True, True, False, True]  # which rounds the rule sends to decode alone
STREAMED = {2, 4}  # these rounds stream (usage in the last event)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("cond-disagg"))
    try:
        (p,), (d,) = m.start_workers(1, 1)
        on = m.start_router([p], [d], "--request-timeout", "60", "--local-prefill-max-tokens", str(THRESHOLD),
                            wait=False)
        off = m.start_router([p], [d], "--request-timeout", "60", "--local-prefill-max-tokens", "0", wait=False)
        m.wait_healthy(on)
        m.wait_healthy(off)
        yield m, p, d, on, off
    finally:
        m.close()


def one_round(router, history: list[int], stream: bool) -> tuple[str, list[int], int]:
    """(text, generated ids, usage's cached_tokens) of one greedy round."""
    body = {"model": "pdmesh-tiny", "prompt": history, "max_tokens": REPLY, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if stream:
        events = stream_events(router.http_url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        chunks = [e["choices"][0] for e in events if e.get("choices")]
        text = "".join(c["text"] for c in chunks)
        ids = [t for c in chunks for t in c.get("token_ids") or []]
        usage = events[-1]["usage"]
    else:
        out = post_json(router.http_url, "/v1/completions", body)
        text, ids, usage = out["choices"][0]["text"], out["choices"][0]["token_ids"], out["usage"]
    assert len(ids) == REPLY
    return text, ids, usage["prompt_tokens_details"]["cached_tokens"]


def counters(p, d, router) -> dict[str, float]:
    mp, md, mr = p.metrics(), d.metrics(), router.metrics()
    return {
        "prefill_requests": mp.get("pdmesh:num_requests_total", 0.0),
        "prefill_computed": mp.get("pdmesh:prompt_tokens_total", 0.0),
        "kv_moved": mp.get("pdmesh:kv_transfer_bytes_sum", 0.0),
        "decode_requests": md.get("pdmesh:num_requests_total", 0.0),
        "local": mr.get("pdmesh:router_local_prefill_requests_total", 0.0),
    }


def attempt_paths(router) -> list[str]:
    paths = []
    for line in router.log().splitlines():
        if '"attempt"' in line:
            event = json.loads(line)
            if event.get("event") == "attempt":
                paths.append(event["path"])
    return paths


def converse(p, d, router, local_on: bool) -> list[str]:
    rng = random.Random(24)
    history = [rng.randrange(3, 256) for _ in range(FIRST)]
    texts = []
    for i, goes_local in enumerate(LOCAL):
        before = counters(p, d, router)
        text, ids, cached = one_round(router, history, stream=i in STREAMED)
        after = counters(p, d, router)
        grew = {k: after[k] - before[k] for k in after}
        assert grew["decode_requests"] == 1, f"round {i + 1}"
        if local_on and goes_local:
            assert grew["prefill_requests"] == 0 and grew["prefill_computed"] == 0, f"round {i + 1}: {grew}"
            assert grew["kv_moved"] == 0 and grew["local"] == 1, f"round {i + 1}: {grew}"
            assert len(history) - cached <= THRESHOLD and cached > 0, f"round {i + 1}: cached {cached}"
        else:
            assert grew["prefill_requests"] == 1 and grew["local"] == 0, f"round {i + 1}: {grew}"
            assert grew["kv_moved"] > 0, f"round {i + 1}: {grew}"
        if i:
            assert cached > 0, f"round {i + 1}: nothing cached"
        texts.append(text)
        if i < len(NEW):
            history = history + ids + [rng.randrange(3, 256) for _ in range(NEW[i])]
    return texts


def test_short_rounds_skip_prefill_and_output_matches_pd(mesh):
    m, p, d, on, off = mesh
    pd_texts = converse(p, d, off, local_on=False)
    assert attempt_paths(off) == ["pd"] * len(LOCAL)
    resp = httpx.post(off.http_url + "/reset_prefix_cache", timeout=10)
    assert resp.status_code == 200 and all(w["ok"] for w in resp.json()["workers"]), resp.text
    wait_for(lambda: p.metrics()["pdmesh:prefix_cache_pages"] == 0 == d.metrics()["pdmesh:prefix_cache_pages"],
             5, "both caches empty")
    local_texts = converse(p, d, on, local_on=True)
    assert attempt_paths(on) == ["local" if g else "pd" for g in LOCAL]
    assert local_texts == pd_texts
    m.assert_invariants()
