"""One request's size or cost never hurts another: real prefill, decode and routers.

- n = 16 with a 4.5 MB tool schema (one lane message of 72 MB, past gRPC's 64 MB, if carried) is
  a 400 naming the limit, and n = 16 with a 30 kB schema is carried, while small streams on the
  same workers all succeed;
- `((a{60}){60}){60}`-style regexes are refused at the router with a 400 while normal streams
  run next to them;
- behind a router that lets them through, decode fails only the rooms whose grammar overruns
  --grammar-step-budget; the streams beside them finish.
After each: the routers hold no request, queue gauges 0, every KV page free.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.http_client import stream_events
from tests.integration.mesh import Mesh, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

MODEL = "pdmesh-tiny"
EXPENSIVE = ["((a{60}){60}){60}", "((b{60}){60}){60}", "((c{50}){60}){60}", "((d{60}){50}){60}"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("cost"))
    try:
        (p,), (d,) = m.start_workers(1, 1, (), ("--grammar-step-budget", "0.05"))
        guarded = m.start_router([p], [d], "--request-timeout", "120")
        open_door = m.start_router([p], [d], "--request-timeout", "120", "--grammar-mask-budget", "1000",
                                   "--grammar-compile-budget", "1000")
        yield m, guarded, open_door
    finally:
        m.close()


def _settled(m: Mesh, *routers) -> None:
    for r in routers:
        wait_for(lambda r=r: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 20, "router holds no request")
    m.assert_invariants(timeout=30)


def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24,
            "temperature": 0.0, **extra}


def _stream_with_gaps(r, body: dict) -> tuple[str, float]:
    """The streamed text and the longest wait between two events."""
    gaps, last = [0.0], time.monotonic()
    text = []
    with httpx.stream("POST", r.http_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event["choices"]:
                    text.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(text), max(gaps)


def _tool(properties: int) -> dict:
    schema = {"type": "object", "properties": {f"field_{i:06d}": {"type": "string", "description": "d" * 40}
                                               for i in range(properties)}}
    return {"type": "function", "function": {"name": "record", "parameters": schema}}


def test_a_huge_tool_schema_times_n_is_refused_and_small_streams_on_the_worker_succeed(cluster):
    m, r, _ = cluster
    huge = _chat("Call it.", n=16, tools=[_tool(60_000)], tool_choice="required")
    assert len(json.dumps(huge)) > 4_000_000
    medium = _chat("Call it.", n=16, tools=[_tool(400)], tool_choice="required", max_tokens=8)
    with ThreadPoolExecutor(12) as pool:
        small = [pool.submit(stream_events, r.http_url, "/v1/chat/completions", _chat(f"Tell me about {i}."), 120)
                 for i in range(8)]
        refused = pool.submit(httpx.post, r.http_url + "/v1/chat/completions", json=huge, timeout=120)
        carried = pool.submit(httpx.post, r.http_url + "/v1/chat/completions", json=medium, timeout=120)
        for f in small:
            events = f.result()
            assert events[-1]["choices"] == [] or events[-1]["choices"][0]["finish_reason"]
        reply = refused.result()
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "grammar_too_large" and error["param"] == "tools"
        assert "--max-grammar-bytes" in error["message"]
        reply = carried.result()
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"]) == 16
    _settled(m, r)


def _regexes_beside_normal_streams(r, normal_prompt: str, regexes) -> tuple[list, list[tuple[str, float]]]:
    """Four normal chat streams (normal_prompt formatted with 0..3) and one chat per regex as its
    structured output, all at once: (the regex chats' replies, the streams' (text, longest gap))."""
    with ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(_stream_with_gaps, r, _chat(normal_prompt.format(i))) for i in range(4)]
        expensive = [pool.submit(httpx.post, r.http_url + "/v1/chat/completions",
                                 json=_chat("Say a.", structured_outputs={"regex": rx}), timeout=120)
                     for rx in regexes]
        return [f.result() for f in expensive], [f.result() for f in normal]


def test_expensive_grammars_are_refused_at_the_router_beside_normal_streams(cluster):
    m, r, _ = cluster
    replies, streams = _regexes_beside_normal_streams(r, "Describe the module {}.", EXPENSIVE)
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "grammar_too_expensive"
        assert reply.json()["error"]["param"] == "structured_outputs"
    for text, gap in streams:
        assert text
        assert gap < 10, f"a normal stream waited {gap:.1f} s between two events"
    _settled(m, r)


def test_a_grammar_over_the_step_budget_fails_its_own_room_only(cluster):
    m, _, open_door = cluster
    replies, streams = _regexes_beside_normal_streams(open_door, "Explain the value {}.", EXPENSIVE[:2])
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert "--grammar-step-budget" in reply.json()["error"]["message"]
    for text, _ in streams:
        assert text
    _settled(m, open_door)
