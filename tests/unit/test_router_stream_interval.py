"""vLLM's `stream_interval`: a stream's events carry N tokens each, the first and the last at once,
whatever decode's chunking; joined, the events give what interval 1 gives (text, logprobs, token
ids, usage). Through the router process's own server, against scripted workers."""

from __future__ import annotations

import httpx
import pytest

from services.fakes.workers import Behaviour
from services.router.stream_interval import IntervalBatch
from tests.unit.test_router_app import Cluster, chat, completion, post, sse_payloads
from tests.unit.test_router_failover import PROMPT, expected, make  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)


def sizes(interval: int, tokens: int, finish_at: int | None = None) -> list[int]:
    """Tokens per step that IntervalBatch lets out for `tokens` tokens, the last (or `finish_at`)
    finishing the output."""
    batch, out, held = IntervalBatch(interval), [], 0
    last = tokens if finish_at is None else finish_at
    for n in range(1, last + 1):
        held += 1
        step = batch.add("x", [], "length" if n == last else None)
        if step is not None:
            assert step[0] == "x" * held
            out.append(held)
            held = 0
    return out


def test_the_first_token_goes_alone_then_n_at_a_time_and_the_last_at_once():
    assert sizes(3, 7) == [1, 3, 3]
    assert sizes(3, 6) == [1, 3, 2]
    assert sizes(4, 1) == [1]
    assert sizes(2, 5, finish_at=3) == [1, 2]


def test_held_back_text_does_not_count_as_the_first_output():
    batch = IntervalBatch(3)
    assert batch.add("", [], None) == ("", [], None)  # a stop string's possible start: nothing to show
    assert batch.add("a", [], None) == ("a", [], None)  # the first output with text goes at once
    assert batch.add("b", [1], None) is None
    assert batch.flush() == ("b", [1], None)
    assert batch.flush() is None


@pytest.fixture
def cluster():
    c = Cluster(n_decode=1)
    c.decodes[0].positional = True
    yield c
    c.close()


def per_event(events: list) -> list[tuple[int, int, str, list, str | None]]:
    """(choice, tokens, text, logprob tokens, finish_reason) of each event with a choice."""
    out = []
    for e in events:
        for ch in e["choices"]:
            text = ch["text"] if "text" in ch else ch["delta"].get("content", "")
            lp = ch.get("logprobs") or {}
            lp_tokens = lp.get("tokens") or [c["token"] for c in lp.get("content") or []]
            out.append((ch["index"], len(ch.get("token_ids") or []), text, lp_tokens, ch["finish_reason"]))
    return out


def joined(rows: list, choice: int = 0) -> tuple[str, list, int]:
    mine = [r for r in rows if r[0] == choice]
    return "".join(r[2] for r in mine), [t for r in mine for t in r[3]], sum(r[1] for r in mine)


BODIES = [
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11, return_token_ids=True)),
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=11, logprobs=1, return_token_ids=True)),
    ("/v1/completions", completion(prompt=PROMPT, max_tokens=20, stop=["o, w"], return_token_ids=True)),
    ("/v1/chat/completions", chat(max_tokens=10, logprobs=True, top_logprobs=1, return_token_ids=True)),
]


@pytest.mark.parametrize("chunk_tokens", [1, 3])
@pytest.mark.parametrize("path,body", BODIES)
def test_events_carry_n_tokens_and_join_to_what_interval_1_gives(cluster, path, body, chunk_tokens):
    cluster.decodes[0].chunk_tokens = chunk_tokens
    req = {**body, "stream": True, "stream_options": {"include_usage": True}}
    one = sse_payloads(post(cluster, path, req).text)
    four = sse_payloads(post(cluster, path, {**req, "stream_interval": 4}).text)
    rows_one, rows_four = per_event(one), per_event(four)
    assert joined(rows_four) == joined(rows_one)
    assert four[-1]["usage"] == one[-1]["usage"]
    counts = [r[1] for r in rows_four if r[1]]
    assert counts[0] == 1 and all(c == 4 for c in counts[1:-1]) and 1 <= counts[-1] <= 4, counts
    assert rows_four[-1][4] == rows_one[-1][4] is not None  # the finish reason rides the last one
    cluster.all_rpcs_ended()


def test_each_choice_of_n_is_batched_on_its_own(cluster):
    req = completion(prompt=PROMPT, max_tokens=9, n=2, seed=3, stream=True, return_token_ids=True,
                     stream_interval=3)
    rows = per_event(sse_payloads(post(cluster, "/v1/completions", req).text))
    for choice in (0, 1):
        assert [r[1] for r in rows if r[0] == choice] == [1, 3, 3, 2]
        assert joined(rows, choice)[0] == expected(cluster, 9)
    cluster.all_rpcs_ended()


def test_tokens_held_when_the_stream_fails_go_out_before_the_error(make):  # noqa: F811
    c = make(n_decode=2, max_migrations=1)
    for d in c.decodes:
        d.behaviour = Behaviour(mode="fail_after", after=2)
    r = post(c, "/v1/completions", completion(prompt=PROMPT, stream=True, max_tokens=20, stream_interval=5))
    events = sse_payloads(r.text)
    assert events[-1]["error"]["code"] == "worker_failure"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected(c, 4)
    assert len(events) == 3  # the first token, then the three held when the last decode failed
    c.all_rpcs_ended()


def test_a_non_streamed_request_ignores_it(cluster):
    body = completion(prompt=PROMPT, max_tokens=6)
    assert post(cluster, "/v1/completions", {**body, "stream_interval": 3}).json()["choices"] == \
        post(cluster, "/v1/completions", body).json()["choices"]
    cluster.all_rpcs_ended()


@pytest.mark.parametrize("value", [0, -1, "2", 2.5, True, 1 << 21])
def test_a_bad_interval_is_a_400_naming_it(cluster, value):
    r = post(cluster, "/v1/chat/completions", chat(stream=True, stream_interval=value))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stream_interval" and "stream_interval" in error["message"]


def test_null_is_the_default(cluster):
    r = httpx.post(cluster.url + "/v1/completions", json=completion(stream=True, stream_interval=None), timeout=10)
    assert r.status_code == 200 and sse_payloads(r.text)
    cluster.all_rpcs_ended()
