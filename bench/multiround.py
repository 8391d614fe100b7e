"""Multi-round conversations through the router: what the prefix cache saves per turn.

Seeded agentic-style chats: N conversations x T turns, one shared system prompt, each turn the
whole history plus a new user message of a few dozen words, the assistant's reply appended as
text (the router tokenizes the history again each turn, as a client's harness makes it). The
turns of all conversations interleave (conversation 0 turn 1, conversation 1 turn 1, ...), so a
conversation's next turn comes after the others' (its think time); requests are sequential so
that each one's worker counters are its own.

Per turn it records, from the client: time to first token (streamed), prompt tokens and
`usage.prompt_tokens_details.cached_tokens`; from the workers' metrics: prompt tokens prefill
computed (`prompt_tokens_total`), prompt pages it READ from decode's held prefix
(`kv_read_pages_total`) and KV bytes sent (`kv_transfer_bytes_sum`). Two meshes run the
same conversations in the same run, one pair each: `--prefix-cache on` and `off`, both with
conditional disaggregation off (router --local-prefill-max-tokens 0: every turn through prefill,
so the reuse figures are prefill's and the transfer's own); then the cache-on pair again, its
caches emptied (POST /reset_prefix_cache), behind a router with conditional disaggregation on
(`pd_cache_on_local`, --local-prefill-max-tokens N): a turn whose uncached part is at most N
tokens goes to decode alone (`local` counts them; their prompt is computed on decode, so prefill's
computed tokens and the KV bytes are 0). `pd_read_off`: a third pair with the cache on but
`--kv-read-held-prefix off` (prefill recomputes the previous reply, which only decode saw). With
--colocated a fifth, colocated with the cache on (decode computes prompts itself, nothing moves).
--sides runs only the named sides.

Usage: python bench/multiround.py [--conversations 2] [--turns 16] [--user-words 60]
       [--max-tokens 24] [--seed 0] [--local-prefill-max-tokens 512] [--colocated]
       [--sides pd_cache_on,pd_read_off]
       > bench/out/multiround.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from services.launch.launcher import Launcher  # noqa: E402
from services.launch.proc import Proc  # noqa: E402

MODEL = "pdmesh-tiny"
WORDS = ("the file object returns a list of values for each key in the mapping when called with "
         "an optional argument that names the default encoding used by this module and its "
         "functions raise an error if the path does not exist or cannot be read").split()


def conversation_turns(rng: random.Random, turns: int, user_words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(user_words // 2, user_words)))
            for _ in range(turns)]


def worker_counters(router: Proc, proc: Proc | None) -> tuple[float, float, float, float]:
    local = router.metrics().get("pdmesh:router_local_prefill_requests_total", 0.0)
    if proc is None:
        return 0.0, 0.0, local, 0.0
    m = proc.metrics()
    return (m.get("pdmesh:prompt_tokens_total", 0.0), m.get("pdmesh:kv_transfer_bytes_sum", 0.0), local,
            m.get("pdmesh:kv_read_pages_total", 0.0))


def one_turn(router: Proc, counted: Proc | None, messages: list[dict], max_tokens: int) -> dict:
    before = worker_counters(router, counted)
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with httpx.stream("POST", router.http_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for choice in ev.get("choices") or ():
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    after = worker_counters(router, counted)
    return {
        "ttft_ms": round((ttft or 0.0) * 1e3, 2),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "computed_tokens": int(after[0] - before[0]) if counted is not None else None,
        "kv_bytes": int(after[1] - before[1]) if counted is not None else None,
        "local": int(after[2] - before[2]),  # 1: sent to decode alone (conditional disaggregation)
        "read_pages": int(after[3] - before[3]) if counted is not None else None,
        "reply": "".join(text),
    }


def run_mode(router: Proc, counted: Proc | None, convs: list[list[str]], system: str, max_tokens: int) -> list[list]:
    """Every conversation's turns, interleaved; returns per conversation the list of turn records."""
    histories = [[{"role": "system", "content": system}] for _ in convs]
    out: list[list] = [[] for _ in convs]
    for t in range(len(convs[0])):
        for c, turns in enumerate(convs):
            histories[c].append({"role": "user", "content": turns[t]})
            rec = one_turn(router, counted, histories[c], max_tokens)
            histories[c].append({"role": "assistant", "content": rec.pop("reply")})
            out[c].append(rec)
    return out


def summary(per_conv: list[list]) -> dict:
    turns = len(per_conv[0])

    def median(key, t):
        vals = [conv[t][key] for conv in per_conv if conv[t][key] is not None]
        return statistics.median(vals) if vals else None

    keys = ("ttft_ms", "prompt_tokens", "cached_tokens", "computed_tokens", "kv_bytes", "read_pages")
    rows = [{k: median(k, t) for k in keys} for t in range(turns)]
    out = {"per_turn_median": rows, "local_turns": sum(rec["local"] for conv in per_conv for rec in conv)}
    if turns >= 2 and rows[1]["ttft_ms"]:
        out["last_over_second_ttft"] = round(rows[-1]["ttft_ms"] / rows[1]["ttft_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--user-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-prefill-max-tokens", type=int, default=512,
                    help="the pd_cache_on_local router's threshold (conditional disaggregation)")
    ap.add_argument("--colocated", action="store_true", help="also a colocated decode with the cache on")
    ap.add_argument("--sides", default="", help="comma-separated sides to run (default: all)")
    args = ap.parse_args()
    sides = set(filter(None, args.sides.split(","))) or {"pd_cache_on", "pd_cache_off", "pd_cache_on_local",
                                                        "pd_read_off", "colocated_cache_on"}

    rng = random.Random(args.seed)
    system = "You are a careful assistant. " + " ".join(rng.choice(WORDS) for _ in range(80))
    convs = [conversation_turns(rng, args.turns, args.user_words) for _ in range(args.conversations)]
    quiet = {"PDMESH_LOG_LEVEL": "warning"}
    with tempfile.TemporaryDirectory() as tmp:
        m = Launcher(log_dir=pathlib.Path(tmp))
        try:
            def pair(*flags):
                return m.start_prefill(*flags, env=quiet, wait=False), m.start_decode(*flags, env=quiet, wait=False)

            on = sides & {"pd_cache_on", "pd_cache_on_local"}
            p_on, d_on = pair() if on else (None, None)
            p_off, d_off = pair("--prefix-cache", "off") if "pd_cache_off" in sides else (None, None)
            p_nr, d_nr = pair("--kv-read-held-prefix", "off") if "pd_read_off" in sides else (None, None)
            c_on = m.start_decode(env=quiet, wait=False) if args.colocated and "colocated_cache_on" in sides else None
            for w in (p_on, d_on, p_off, d_off, p_nr, d_nr, c_on):
                if w is not None:
                    m.wait_healthy(w)
            no_local = ("--local-prefill-max-tokens", "0")  # reuse measured with every turn through prefill
            routers = {}
            if "pd_cache_on" in sides:
                routers["pd_cache_on"] = (m.start_router([p_on], [d_on], *no_local, env=quiet), p_on)
            if "pd_cache_off" in sides:
                routers["pd_cache_off"] = (m.start_router([p_off], [d_off], *no_local, env=quiet), p_off)
            if "pd_read_off" in sides:
                routers["pd_read_off"] = (m.start_router([p_nr], [d_nr], *no_local, env=quiet), p_nr)
            if "pd_cache_on_local" in sides:
                routers["pd_cache_on_local"] = (m.start_router([p_on], [d_on], "--local-prefill-max-tokens",
                                                               str(args.local_prefill_max_tokens), env=quiet), p_on)
            if c_on is not None:
                routers["colocated_cache_on"] = (m.start_router([], [c_on], "--mode", "colocated", env=quiet), None)
            results = {}
            for name, (router, counted) in routers.items():
                if name == "pd_cache_on_local":  # the same workers as pd_cache_on: start from empty caches
                    resp = httpx.post(router.http_url + "/reset_prefix_cache", timeout=30)
                    if resp.status_code != 200:
                        raise RuntimeError(f"reset_prefix_cache: HTTP {resp.status_code}: {resp.text[:300]}")
                per_conv = run_mode(router, counted, convs, system, args.max_tokens)
                results[name] = {**summary(per_conv), "conversations": per_conv}
        finally:
            m.close()
    json.dump({
        "bench": "multiround",
        "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "params": vars(args),
        "results": results,
    }, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
