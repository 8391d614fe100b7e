"""NVIDIA AIPerf (pinned in .venv-clients) profiles the router: streamed chat, multi-turn sessions
(each turn sends the conversation so far), and a share of requests cancelled shortly after they
are sent (AIPerf disconnects). AIPerf reports no error but those cancellations, the cancellations
reach the workers (their aborted-requests counters grow), every session's later turns carry a
longer prompt than its first, and afterwards every pdmesh queue gauge is 0 and the KV pools whole.

Over the OpenAI chat route, and over Anthropic's Messages API (`--endpoint-type messages`: the
conversation's system prompt top-level, streamed `content_block_delta` events, usage split into
computed and cache-read tokens, which AIPerf adds back up into the prompt's length).

`make test` runs the short profile on both; the long one (`-m long`, `make clients-test`) runs
more sessions, turns and concurrency, on the chat route.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from services.common.tokenizer import BUILTIN_MODEL_DIR
from tests.clients.clients_venv import CLIENTS_BIN, run_client
from tests.integration.mesh import scrape_metrics

pytestmark = [pytest.mark.integration]

MODEL = "pdmesh-tiny"
ABORTED = "pdmesh:num_aborted_requests_total"
PROFILES = {
    "short": {"sessions": 6, "turns": 3, "concurrency": 3, "cancel_pct": 30, "isl": 32, "osl": 24},
    "long": {"sessions": 24, "turns": 4, "concurrency": 6, "cancel_pct": 25, "isl": 64, "osl": 32},
}


def aborted_total(mesh) -> float:
    return sum(scrape_metrics(p.http_url).get(ABORTED, 0.0) for p in mesh.procs if p.role in ("prefill", "decode"))


@pytest.mark.parametrize("size, endpoint", [
    pytest.param("short", "chat", marks=pytest.mark.timeout(420)),
    pytest.param("short", "messages", marks=pytest.mark.timeout(420)),
    pytest.param("long", "chat", marks=[pytest.mark.long, pytest.mark.timeout(900)]),
])
def test_aiperf_streaming_multi_turn_with_cancellations(pd_router, tmp_path, size, endpoint):
    m, router = pd_router
    prof = PROFILES[size]
    out_dir = tmp_path / "aiperf"
    aborted_before = aborted_total(m)
    run_client([
        str(CLIENTS_BIN / "aiperf"), "profile", "--model", MODEL, "--url", router.http_url,
        "--endpoint-type", endpoint, "--streaming",
        # a local folder: AIPerf cannot load one with HF_HUB_OFFLINE=1 set, so the env leaves it out
        "--tokenizer", str(BUILTIN_MODEL_DIR),
        "--conversation-num", str(prof["sessions"]), "--conversation-turn-mean", str(prof["turns"]),
        "--conversation-turn-stddev", "0", "--concurrency", str(prof["concurrency"]),
        "--request-cancellation-rate", str(prof["cancel_pct"]), "--request-cancellation-delay", "0.05",
        "--isl", str(prof["isl"]), "--osl", str(prof["osl"]), "--random-seed", "1",
        # one worker process (it keeps `concurrency` requests in flight on its event loop): each
        # AIPerf service is a process of its own, and starting them is most of a short run's CPU
        "--ui", "none", "--artifact-dir", str(out_dir), "--no-server-metrics", "--no-gpu-telemetry",
        "--workers-max", "1", "--record-processors", "1", "--request-timeout-seconds", "120",
    ], tmp_path, timeout=840 if size == "long" else 360, env={"HF_HUB_DISABLE_TELEMETRY": "1"})

    summary = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    records = [json.loads(line) for line in (out_dir / "profile_export.jsonl").read_text().splitlines() if line]
    assert not summary["was_cancelled"] and summary["is_complete"]
    assert len(records) == prof["sessions"] * prof["turns"]
    cancelled = [r for r in records if r["metadata"]["was_cancelled"]]
    completed = [r for r in records if not r["metadata"]["was_cancelled"]]
    # the only errors are the intended cancellations
    for r in records:
        if "error" in r or r["metadata"]["was_cancelled"]:
            assert r["metadata"]["was_cancelled"] and r["error"]["type"] == "RequestCancellationError", r
    assert {e["error_details"]["type"] for e in summary["error_summary"]} <= {"RequestCancellationError"}
    errors = summary.get("error_request_count", {}).get("avg", 0)
    assert errors == len(cancelled) and cancelled and completed, (errors, len(cancelled), len(completed))
    # streamed: every completed reply arrived in several chunks, each with the tokens AIPerf asked for
    for r in completed:
        assert len(r["metrics"]["inter_chunk_latency"]["value"]) >= 1, r
        assert r["metrics"]["output_sequence_length"]["value"] >= 1, r
    # multi-turn: a session's later turn sends the earlier exchange too, so its prompt is longer
    by_session = defaultdict(dict)
    for r in completed:
        by_session[r["metadata"]["conversation_id"]][r["metadata"]["turn_index"]] = \
            r["metrics"]["usage_prompt_tokens"]["value"]
    later = [(t[0], t[k]) for t in by_session.values() if 0 in t for k in t if k > 0]
    assert later, by_session
    assert all(b > a for a, b in later), by_session
    print(f"aiperf {size} {endpoint}: {len(completed)} completed, {len(cancelled)} cancelled, "
          f"TTFT avg {summary['time_to_first_token']['avg']:.1f} ms, "
          f"throughput {summary['output_token_throughput']['avg']:.1f} tok/s")
    assert aborted_total(m) > aborted_before, "no cancellation reached a worker"
    m.assert_invariants()
