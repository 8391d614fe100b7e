"""Added latency of one request migration, printed as JSON.

A real mesh (1 prefill, 2 decodes, router; real gRPC and NIXL). A streamed greedy completion
is read token by token; once the client holds `at` tokens, the decode running it is SIGKILLed.
The router re-submits prompt + generated ids to the other decode (services/router/orchestrator.py)
and the stream continues. Measured per run:

- `max_gap_ms`: the longest silence between two token-bearing SSE events as the client sees it,
  for migrated runs and for uninterrupted ones; `added_latency_ms` = migrated − uninterrupted
  (medians) is the migration's own cost: failure noticed, new pair chosen, prefill of prompt +
  `at` tokens, KV moved, first token. (The kill → next-token time is no measure: the client is
  usually behind decode, and tokens already in the router's and the socket's buffers keep
  arriving after the kill.)
- `e2e_ms`: end-to-end times both ways, for scale. Not a cost measure on a small machine: after the
  kill one decode process fewer competes for the cores, which can make a migrated run finish sooner.

At `at` = 100 and 1,000 generated tokens by default, `--runs` times each (the killed decode is
restarted between runs). Everything shares this machine's cores: compare within one run.

Usage: python bench/migration.py [--at 100 1000] [--runs 3] [--tail 500]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from services.launch.launcher import Launcher  # noqa: E402
from services.launch.probes import wait_for  # noqa: E402

MODEL = "pdmesh-tiny"
PROMPT = "Measure the migration of this request, please."
ROUTER_FLAGS = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5", "--request-timeout", "300")


def stream(url: str, max_tokens: int, kill_at: int | None, kill) -> dict:
    """One streamed greedy completion; returns timings (and the kill → next-token gap)."""
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True, "logprobs": 0}
    tokens, killed_at, last, max_gap = 0, None, None, 0.0
    t0 = time.monotonic()
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=payload) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            lp = event["choices"][0]["logprobs"] if event.get("choices") else None
            n = len(lp["tokens"]) if lp else 0
            if n:
                now = time.monotonic()
                if last is not None:
                    max_gap = max(max_gap, now - last)
                last = now
            tokens += n
            if kill_at is not None and killed_at is None and tokens >= kill_at:
                kill()
                killed_at = time.monotonic()
    assert tokens == max_tokens, (tokens, max_tokens)
    return {"e2e": time.monotonic() - t0, "max_gap": max_gap}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ms(runs: list[dict], key: str) -> dict[str, float]:
    values = [r[key] * 1000 for r in runs]
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def running_decode(router, decodes):
    status = httpx.get(router.http_url + "/health", timeout=5).json()["decode"]
    running = [d for d in decodes if status[d.grpc_addr]["inflight"] > 0]
    if not running:
        sys.exit("no decode is running the request at the kill point: it finished first (give a longer --tail)")
    return running[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", type=int, nargs="+", default=[100, 1000], help="generated tokens before the kill")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tail", type=int, default=500, help="tokens generated after the migration point")
    args = ap.parse_args(argv)

    m = Launcher(log_dir=pathlib.Path(tempfile.mkdtemp(prefix="bench-migration-")))
    results = []
    try:
        (p,), ds = m.start_workers(1, 2)
        r = m.start_router([p], ds, *ROUTER_FLAGS)
        for at in args.at:
            max_tokens = at + args.tail
            stream(r.http_url, max_tokens, None, None)  # warm-up
            base = [stream(r.http_url, max_tokens, None, None) for _ in range(args.runs)]
            migrated = []
            for _ in range(args.runs):
                victim = {}

                def kill(victim=victim):
                    victim["proc"] = running_decode(r, ds)
                    victim["proc"].kill()

                migrated.append(stream(r.http_url, max_tokens, at, kill))
                dead = victim["proc"]
                ds[ds.index(dead)] = new = m.restart(dead)
                wait_for(lambda new=new: httpx.get(r.http_url + "/health", timeout=5)
                         .json()["decode"][new.grpc_addr]["healthy"], 30, "the restarted decode re-admitted")
            results.append({
                "generated_before_migration": at,
                "max_tokens": max_tokens,
                "added_latency_ms": round((med(migrated, "max_gap") - med(base, "max_gap")) * 1000, 1),
                "max_gap_ms": {"migrated": ms(migrated, "max_gap"), "uninterrupted": ms(base, "max_gap")},
                "e2e_ms": {"migrated": ms(migrated, "e2e"), "uninterrupted": ms(base, "e2e")},
                "runs": args.runs,
            })
    finally:
        m.close()
    print(json.dumps({"bench": "migration", "prompt_chars": len(PROMPT), "results": results}, indent=2))


if __name__ == "__main__":
    main()
