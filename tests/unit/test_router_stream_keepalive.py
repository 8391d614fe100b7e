"""A started stream that stays silent gets SSE keep-alive comments (--stream-keepalive-interval),
which clients skip: on the router's own server with scripted gRPC workers, through slow tokens, a
stalled decode and the migration after it, a first token slower than the interval (the stream
then begins before it), and on the Responses API's stream; the openai SDK reads the same text as
without them."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from services.common.refusal import Refusal
from services.fakes.workers import Behaviour
from services.router.stream_keepalive import KEEPALIVE, IdleTimer
from tests.unit.test_router_app import MODEL, chat, completion, post
from tests.unit.test_router_failover import PROMPT, expected, make  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)

COMMENT = KEEPALIVE.decode()


def events_of(body: str) -> tuple[list[str], int]:
    """(the data events, the keep-alive comments) of an SSE body; nothing else may be in it."""
    parts = body.split("\n\n")
    assert parts[-1] == "", body[-200:]
    data = [p for p in parts[:-1] if p.startswith("data: ")]
    comments = [p for p in parts[:-1] if p == COMMENT.rstrip("\n")]
    assert len(data) + len(comments) == len(parts) - 1, body
    return data, len(comments)


def test_slow_tokens_get_comments_between_them_and_the_sdk_skips_them(make):  # noqa: F811
    c = make(stream_keepalive_interval=0.1)
    c.decodes[0].behaviour.token_delay = 0.45
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=4))
    data, comments = events_of(r.text)
    assert comments >= 6, r.text  # three silences of 0.45 s, a comment every 0.1 s after the first 0.1 s
    assert data[-1] == "data: [DONE]" and not r.text.startswith(":")  # never before the first event
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=20)
    text = "".join(e.choices[0].text for e in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
    assert text == expected(c, 4)
    c.all_rpcs_ended()


def test_a_stalled_decode_and_the_migration_after_it_keep_the_connection_talking(make):  # noqa: F811
    c = make(n_decode=2, stream_stall_timeout=0.8, health_check_interval=30, stream_keepalive_interval=0.15)
    c.decodes[0].behaviour = Behaviour(mode="hang_after", after=3)
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", c.url + "/v1/completions", json=completion(prompt=PROMPT, stream=True, max_tokens=8)) as s:
        arrivals = []  # (seconds since the start, the line)
        for line in s.iter_lines():
            arrivals.append((time.monotonic() - t0, line))
    body = "".join(line + "\n" for _, line in arrivals)
    data, comments = events_of(body)
    assert comments >= 3, body  # the 0.8 s of silence before the router gives up on decode 0
    text = "".join(json.loads(d[6:])["choices"][0]["text"] for d in data[:-1])
    assert text == expected(c, 8)
    assert c.metric("pdmesh:router_migrations_total", reason="decode_stalled") == 1
    # no gap in what the client heard was longer than about one interval
    times = [t for t, line in arrivals if line]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 0.6, arrivals
    c.all_rpcs_ended()


def test_a_first_token_slower_than_the_interval_starts_the_stream_with_a_comment(make):  # noqa: F811
    c = make(stream_keepalive_interval=0.1)
    c.decodes[0].behaviour.delay = 0.6  # a long prefill, or a wait for the pair, before the first token
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", c.url + "/v1/completions", json=completion(prompt=PROMPT, stream=True, max_tokens=4)) as s:
        headers_after = time.monotonic() - t0
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        body = "".join(s.iter_text())
    assert headers_after < 0.45, headers_after  # the status did not wait for the token
    assert body.startswith(COMMENT), body[:80]
    data, comments = events_of(body)
    assert comments >= 3, body
    assert "".join(json.loads(d[6:])["choices"][0]["text"] for d in data[:-1]) == expected(c, 4)
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=20)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    whole = client.chat.completions.create(**ask).choices[0].message.content
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole and whole
    # the Responses API's stream, made from the chat one, begins with the comment as well
    r = post(c, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.startswith(COMMENT), r.text[:200]
    kinds = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    c.all_rpcs_ended()


def test_a_client_that_leaves_before_the_first_token_ends_its_request(make):  # noqa: F811
    c = make(stream_keepalive_interval=0.1)
    c.decodes[0].behaviour.delay = 30  # the first token would take 30 s
    with httpx.Client(timeout=10) as client, client.stream(
            "POST", c.url + "/v1/completions", json=completion(prompt=PROMPT, stream=True, max_tokens=4)) as s:
        assert s.status_code == 200
        assert next(s.iter_lines()) == COMMENT.rstrip("\n")  # the stream began; the client leaves
    t0 = time.monotonic()
    c.all_rpcs_ended()  # the Decode RPC cancelled, the slot and the pair's leases released
    assert time.monotonic() - t0 < 3 and c.decodes[0].seen.cancelled == 1
    assert c.metric("pdmesh:router_requests_total", status="499") == 1


def test_a_fast_failure_is_still_a_status_and_a_slow_one_an_error_event(make):  # noqa: F811
    refuse = dict(mode="fail", code=grpc.StatusCode.INVALID_ARGUMENT, refusal=Refusal.KV_CAPACITY,
                  details="this worker's pool is too small")
    c = make(stream_keepalive_interval=0.3)
    c.decodes[0].behaviour = Behaviour(**refuse)
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=4))
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_capacity_exceeded", r.text
    c.decodes[0].behaviour = Behaviour(**refuse, delay=0.8)  # fails after the stream began
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=4))
    assert r.status_code == 200 and r.text.startswith(COMMENT), r.text
    data, _ = events_of(r.text)
    assert data[-1] == "data: [DONE]" and json.loads(data[-2][6:])["error"]["code"] == "kv_capacity_exceeded", data
    assert c.metric("pdmesh:router_requests_total", status="400") == 2
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=20)
    with pytest.raises(openai.APIError, match="more KV cache than any decode worker has"):
        for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True):
            pass
    c.all_rpcs_ended()


def test_chat_and_responses_streams_carry_them_too(make):  # noqa: F811
    c = make(stream_keepalive_interval=0.1)
    c.decodes[0].behaviour.token_delay = 0.35
    r = post(c, "/v1/chat/completions", chat(stream=True, max_tokens=3))
    assert events_of(r.text)[1] >= 2, r.text
    r = post(c, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True})
    assert r.status_code == 200 and COMMENT in r.text, r.text
    kinds = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    c.all_rpcs_ended()


def test_none_when_off_or_when_tokens_flow(make):  # noqa: F811
    c = make(stream_keepalive_interval=0)
    c.decodes[0].behaviour.token_delay = 0.3
    assert events_of(post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=3)).text)[1] == 0
    fast = make(stream_keepalive_interval=5)
    assert events_of(post(fast, "/v1/completions",
                          completion(prompt=PROMPT, stream=True, max_tokens=16)).text)[1] == 0
    c.all_rpcs_ended()
    fast.all_rpcs_ended()


def test_the_timer_counts_from_the_last_write():
    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fired: list[float] = []
        timer = IdleTimer(0.1, lambda: fired.append(loop.time() - t0))
        for _ in range(4):  # writes every 0.05 s: never silent for 0.1 s
            await asyncio.sleep(0.05)
            timer.wrote()
        quiet_from = loop.time() - t0
        await asyncio.sleep(0.35)  # then silent: fires about every 0.1 s
        timer.close()
        await asyncio.sleep(0.15)  # closed: no more
        return [t - quiet_from for t in fired]

    fired = asyncio.run(run())
    assert 2 <= len(fired) <= 4, fired
    assert fired[0] >= 0.095 and all(b - a >= 0.095 for a, b in zip(fired, fired[1:], strict=False)), fired
