"""Serving benchmark: load against any OpenAI-compatible endpoint, measured on the client.

In the spirit of `sglang.bench_serving` / `vllm bench serve`: requests arrive as a Poisson
process at `--rate` requests/s (or all at once), at most `--concurrency` in flight; each is a
streamed `/v1/completions` call whose prompt is a list of token ids (accepted by pdmesh, vLLM
and SGLang), with `ignore_eos` so the output length is what the workload asked for. Per
request the client records the time to first token (TTFT), every inter-token latency (ITL:
gap between consecutive content chunks) and the end-to-end latency (E2E).

Workloads (named, seeded; lengths in tokens, uniform in the ranges):
  chat    prompt 32-256, output 32-128
  rag     prompt 2048-4096, output 16-64
  mixed   short requests (prompt 16-64, output --short-output, default 256-512) with long prompts among them
          (--long-fraction, default 0.15: prompt --long-len, default 1024, output 8): long
          prompts arrive while short requests decode, the case disaggregation is for
  fixed   every request --input-len / --output-len

Output (stdout, JSON): p50/p90/p99/mean of TTFT, ITL, E2E and TPOT in ms; throughput (req/s,
output tok/s); errors; goodput at the SLOs --slo-ttft-ms X and --slo-itl-ms Y: the share of
requests with TTFT <= X and their own p99 ITL <= Y (failed requests count as missing them),
and that count per second. --save-requests FILE also writes every request's arrival, token
times and lengths (the ITL-over-time plot, bench/plot.py). A progress bar goes to stderr.

Usage: python bench/serve.py --base-url http://127.0.0.1:8000 --workload mixed --rate 2
       [--num-requests 60] [--concurrency 256] [--seed 0] [--slo-ttft-ms 2000 --slo-itl-ms 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

WORKLOADS = ("chat", "rag", "mixed", "fixed")


@dataclass
class Spec:
    index: int
    kind: str  # "short" | "long" (mixed), else the workload name
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    index: int
    kind: str
    prompt_len: int
    max_tokens: int
    arrival: float  # seconds since the start of the run (scheduled send time)
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)  # since the run's start, one per content chunk
    output_tokens: int = 0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def make_workload(args) -> list[Spec]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.token_low, args.token_high) for _ in range(n)]

    specs = []
    for i in range(args.num_requests):
        if args.workload == "chat":
            kind, p, o = "chat", rng.randint(32, 256), rng.randint(32, 128)
        elif args.workload == "rag":
            kind, p, o = "rag", rng.randint(2048, 4096), rng.randint(16, 64)
        elif args.workload == "mixed":
            if rng.random() < args.long_fraction:
                kind, p, o = "long", args.long_len, 8
            else:
                lo, hi = (int(x) for x in args.short_output.split(","))
                kind, p, o = "short", rng.randint(16, 64), rng.randint(lo, hi)
        else:
            kind, p, o = "fixed", args.input_len, args.output_len
        specs.append(Spec(i, kind, ids(p), o))
    return specs


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times of a Poisson process at `rate` req/s (all at 0 when rate is inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.errors, self.enabled = total, 0, 0, enabled
        self.t0 = time.monotonic()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.errors += not ok
        if self.enabled:
            w = 30
            filled = int(w * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (w - filled)}] {self.done}/{self.total} "
                             f"errors {self.errors} {time.monotonic() - self.t0:5.1f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def one(client: httpx.AsyncClient, args, spec: Spec, t0: float, arrival: float) -> Result:
    res = Result(spec.index, spec.kind, len(spec.prompt), spec.max_tokens, arrival)
    body = {"model": args.model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", args.base_url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {str(event['error'])[:200]}"
                    return res
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text"):
                    if res.ttft is None:
                        res.ttft = now - start
                    res.token_times.append(now - t0)
                if event.get("usage"):
                    res.output_tokens = event["usage"].get("completion_tokens", 0)
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or len(res.token_times)
        res.ok = res.ttft is not None
        if not res.ok:
            res.error = "no tokens"
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def stats_ms(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "n": 0}
    return {"p50": round(pct(xs, 0.5) * 1e3, 2), "p90": round(pct(xs, 0.9) * 1e3, 2),
            "p99": round(pct(xs, 0.99) * 1e3, 2), "max": round(max(xs) * 1e3, 2),
            "mean": round(sum(xs) / len(xs) * 1e3, 2), "n": len(xs)}


def meets_slo(r: Result, ttft_s: float, itl_s: float) -> bool:
    if not r.ok or r.ttft is None or r.ttft > ttft_s:
        return False
    itls = r.itls
    return not itls or pct(itls, 0.99) <= itl_s


def summarize(results: list[Result], duration: float, args) -> dict:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    met = sum(meets_slo(r, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3) for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    by_kind = {}
    for kind in sorted({r.kind for r in results}):
        rs = [r for r in ok if r.kind == kind]
        by_kind[kind] = {"completed": len(rs), "ttft_ms": stats_ms([r.ttft for r in rs]),
                         "itl_ms": stats_ms([x for r in rs for x in r.itls])}
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "error_samples": [r.error for r in results if not r.ok][:3],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 4),
        "output_throughput": round(out_tokens / duration, 2),
        "input_throughput": round(sum(r.prompt_len for r in ok) / duration, 2),
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "itl_ms": stats_ms(itls),
        "tpot_ms": stats_ms(tpots),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "by_kind": by_kind,
        "goodput": {
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_p99_ms": args.slo_itl_ms},
            "rule": "a request meets the SLO when TTFT <= ttft_ms and the p99 of its own ITLs <= itl_p99_ms",
            "met": met,
            "fraction": round(met / max(1, len(results)), 4),
            "req_per_s": round(met / duration, 4),
        },
    }


async def run(args) -> tuple[dict, list[Result]]:
    specs = make_workload(args)
    sends = arrivals(len(specs), args.rate, args.seed)
    limit = asyncio.Semaphore(args.concurrency)
    progress = Progress(len(specs), not args.no_progress)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(spec: Spec, at: float) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with limit:
                r = await one(client, args, spec, t0, at)
            progress.tick(r.ok)
            return r

        tasks = [asyncio.ensure_future(fire(s, a)) for s, a in zip(specs, sends, strict=True)]
        budget = (sends[-1] if sends else 0) + args.drain_timeout
        done, pending = await asyncio.wait(tasks, timeout=budget)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
    results = []
    for spec, at, task in zip(specs, sends, tasks, strict=True):
        if task in done:
            results.append(task.result())
        else:
            results.append(Result(spec.index, spec.kind, len(spec.prompt), spec.max_tokens, at,
                                  error="cancelled: not done within the last arrival + --drain-timeout"))
    summary = summarize(results, duration, args)
    summary["config"] = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                         if k not in ("no_progress", "save_requests")}
    return summary, results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="pdmesh-tiny")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s, Poisson; inf: all at once")
    p.add_argument("--concurrency", type=int, default=256, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=512, help="fixed workload")
    p.add_argument("--output-len", type=int, default=64, help="fixed workload")
    p.add_argument("--long-len", type=int, default=1024, help="mixed workload: the long prompts' length")
    p.add_argument("--long-fraction", type=float, default=0.15, help="mixed workload: share of long prompts")
    p.add_argument("--short-output", default="256,512", help="mixed workload: LO,HI output tokens of the short requests")
    p.add_argument("--token-low", type=int, default=32, help="prompt token ids are drawn from [low, high)")
    p.add_argument("--token-high", type=int, default=127)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds after the last arrival before unfinished requests are cancelled (counted as errors)")
    p.add_argument("--save-requests", default="", help="write every request's timings to this JSON file")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    summary, results = asyncio.run(run(args))
    if args.save_requests:
        with open(args.save_requests, "w") as f:
            json.dump([{**asdict(r), "itls": r.itls} for r in results], f)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
