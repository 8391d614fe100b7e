"""Decode chunks of several tokens: decode coalesces the tokens a slow stream has not written yet
(services/decode/jobs.py `coalesce`), and the router gives exactly the responses one token per
chunk gives — stream events included — with stop strings, max_tokens, logprobs, n > 1 and
migration. The fake decode's `chunk_tokens` sends a fixed number of tokens per chunk."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.decode.jobs import DecodeFailed, Tokens, coalesce
from services.fakes.workers import Behaviour
from tests.unit.test_router_app import Cluster, chat, completion, post, sse_payloads
from tests.unit.test_router_failover import PROMPT, PROMPT_LEN, expected

pytestmark = pytest.mark.timeout(60)


# --- decode's coalescing ---------------------------------------------------------------------------


def tok(t: int, n: int, finish: str = "") -> Tokens:
    return Tokens([t], [-float(n)], finish, n, [f"top{n}"])


def queue_of(*items) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return q


def test_coalesce_merges_what_is_queued_and_keeps_lists_aligned():
    first = tok(10, 1)
    q = queue_of(tok(11, 2), tok(12, 3, "length"), tok(13, 4))
    merged, held = coalesce(first, q)
    assert merged.token_ids == [10, 11, 12] and merged.logprobs == [-1.0, -2.0, -3.0]
    assert merged.top_logprobs == ["top1", "top2", "top3"]
    assert merged.finish_reason == "length" and merged.completion_tokens == 3 and held is None
    assert first.token_ids == [10]  # the worker's own item is not changed
    assert q.qsize() == 1  # nothing after the finish is taken


def test_coalesce_sends_one_token_when_nothing_waits():
    first = tok(10, 1)
    merged, held = coalesce(first, queue_of())
    assert merged is first and held is None


def test_coalesce_stops_at_a_failure_and_hands_it_back():
    failure = DecodeFailed("gone")
    merged, held = coalesce(tok(10, 1), queue_of(tok(11, 2), failure, tok(12, 3)))
    assert merged.token_ids == [10, 11] and held is failure


def test_coalesce_leaves_a_finished_chunk_alone():
    first = tok(10, 1, "stop")
    q = queue_of(tok(11, 2))
    assert coalesce(first, q) == (first, None) and q.qsize() == 1


# --- the router with multi-token chunks ------------------------------------------------------------


@pytest.fixture
def cluster():
    c = Cluster(n_decode=2)
    for d in c.decodes:
        d.positional = True
    yield c
    c.close()


def chunked(c: Cluster, k: int) -> None:
    for d in c.decodes:
        d.chunk_tokens = k


def normalized(value):
    """A body or event without what differs between two requests (id, created)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def by_choice(events: list) -> list:
    """Events grouped by choice, in order within each: with n > 1 the choices interleave as
    their streams happen to arrive."""
    return sorted(events, key=lambda e: e["choices"][0]["index"] if e["choices"] else 1 << 30)


REQUESTS = [
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11)),
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11, logprobs=2)),
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11, echo=True)),
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=20, stop=["o, w"])),  # stop inside a chunk
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=9, n=2, seed=3)),
    ("/v1/chat/completions", chat(max_tokens=10, logprobs=True, top_logprobs=1)),
    ("/v1/chat/completions", chat(max_tokens=30, stop=["d!"], n=2)),
    # each event carries its own token's id, not the whole chunk's
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11, return_token_ids=True)),
    ("/v1/chat/completions", chat(max_tokens=10, return_token_ids=True, logprobs=True)),
]


@pytest.mark.parametrize("path,body", REQUESTS)
def test_multi_token_chunks_give_the_same_responses(cluster, path, body):
    for stream in (False, True):
        req = {**body, "stream": stream}
        if stream:
            req["stream_options"] = {"include_usage": True}
        got = {}
        for k in (1, 4):
            chunked(cluster, k)
            r = post(cluster, path, req)
            assert r.status_code == 200, r.text
            got[k] = normalized(by_choice(sse_payloads(r.text)) if stream else r.json())
        assert got[4] == got[1], (stream, got[4], got[1])
        cluster.all_rpcs_ended()


@pytest.mark.parametrize("path,body", [("/v1/completions", completion(prompt=PROMPT, max_tokens=11)),
                                       ("/v1/chat/completions", chat(max_tokens=10))])
def test_continuous_usage_counts_each_event_s_own_tokens(cluster, path, body):
    req = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got = {}
    for k in (1, 4):
        chunked(cluster, k)
        events = sse_payloads(post(cluster, path, req).text)
        got[k] = [e["usage"]["completion_tokens"] for e in events]
    assert got[4] == got[1]
    cluster.all_rpcs_ended()


def test_stop_string_inside_a_chunk_cancels_decode_and_counts_tokens_up_to_it(cluster):
    chunked(cluster, 8)
    full = expected(cluster, 16)
    stop = full[3:5]
    r = post(cluster, "/v1/completions", completion(prompt=PROMPT, max_tokens=16, stop=[stop]))
    body = r.json()
    assert body["choices"][0]["text"] == full[:3] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5  # the token that completed the stop string
    cluster.all_rpcs_ended()


@pytest.mark.parametrize("stream", [False, True])
def test_migration_resumes_after_the_last_token_of_a_multi_token_chunk(cluster, stream):
    chunked(cluster, 3)
    d0, d1 = cluster.decodes
    d0.behaviour = Behaviour(mode="fail_after", after=4, code=grpc.StatusCode.UNAVAILABLE)
    r = post(cluster, "/v1/completions", completion(prompt=PROMPT, max_tokens=10, stream=stream, seed=5))
    assert r.status_code == 200, r.text
    if stream:
        events = sse_payloads(r.text)
        text = "".join(e["choices"][0]["text"] for e in events)
        assert sum(1 for e in events if e["choices"][0]["text"]) == 10  # still one event per token
    else:
        text = r.json()["choices"][0]["text"]
    assert text == expected(cluster, 10)
    moved = d1.seen.requests[0]
    assert len(moved.token_ids) == PROMPT_LEN + 4  # chunks [3], [1] then the failure
    assert moved.params.max_tokens == 6 and moved.params.num_generated == 4
    cluster.all_rpcs_ended()


def test_chunks_read_before_the_stream_began_stop_at_the_stop_string(cluster):
    """While the router waits for every choice's first chunk, a fast choice may already have sent
    its stop string and more: what follows the stop is dropped there too (one finish event per
    choice, usage counting tokens up to the stop), as when the chunks come after the stream began."""
    body = chat(max_tokens=30, stop=["d!"], stream=True, stream_options={"include_usage": True})
    one = sse_payloads(post(cluster, "/v1/chat/completions", body).text)
    per_choice = one[-1]["usage"]["completion_tokens"]
    cluster.decodes[1].behaviour.delay = 0.5  # choice 1's first chunk comes after all of choice 0's
    events = sse_payloads(post(cluster, "/v1/chat/completions", {**body, "n": 2}).text)
    finishes = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1], events
    assert events[-1]["usage"]["completion_tokens"] == 2 * per_choice
    texts = ["".join(e["choices"][0]["delta"].get("content") or "" for e in events
                     if e["choices"] and e["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts[0] == texts[1] == "".join(e["choices"][0]["delta"].get("content") or "" for e in one if e["choices"])
    cluster.all_rpcs_ended()
