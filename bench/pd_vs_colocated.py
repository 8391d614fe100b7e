"""What disaggregation buys on this machine: PD against colocated, same router API, one run.

Two meshes run side by side for the whole run (idle while the other is measured), so drift and
other load hit both alike; every load point runs PD then colocated back to back.

  PD         prefill pinned to core 0, decode pinned to core 1 (1 torch thread each), KV over NIXL
  colocated  one decode worker pinned to cores 0-1 (2 torch threads) that computes prompts itself
             (router --mode colocated), chunked under the same --chunked-prefill-size

Both routers and the load generator are not pinned: they share the same two cores with the
workers (this machine has no third one), equally in both modes.

Measured (bench/serve.py, client side):
  sweep      the mixed workload (short requests decoding while long prompts arrive) at each
             --rates point: TTFT, ITL, E2E percentiles, throughput, goodput at the SLOs
  goodput    the highest swept rate at which >= 90 % of requests meet TTFT <= X and p99 ITL <= Y
  mixed ITL  p99 ITL of PD and colocated at --itl-rate, side by side with their ratio; every
             token's time is saved for the ITL-over-time plot (bench/plot.py)
  interference  8 short requests decoding (400 tokens each) when one --interference-len prompt
             arrives: their ITLs while it is computed, PD against colocated (the mechanism
             behind the mixed workload's tail, isolated)
  KV share   PD, one request at a time, prompts of 512 and 4,096 tokens: prefill's
             kv_transfer_latency_seconds histogram (its delta over the request) against the
             client's TTFT

Usage: python bench/pd_vs_colocated.py [--rates 0.25,0.5,0.75,1] [--duration 40] [--itl-rate 0.5]
       [--out bench/out/pd_vs_colocated.json] [--requests-dir bench/out/serve]
Plots: python bench/plot.py bench/out/pd_vs_colocated.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench import serve  # noqa: E402
from services.launch.launcher import Launcher  # noqa: E402
from services.launch.proc import Proc  # noqa: E402

CHUNK = 512
SPLIT = {
    "pd": "prefill pinned to CPU core 0 and decode to core 1, OMP_NUM_THREADS=1 each; router and client unpinned",
    "colocated": "one decode worker pinned to CPU cores 0-1, OMP_NUM_THREADS=2; router and client unpinned",
    "all_workers": "OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning on the shared cores)",
}


def pinned(m: Launcher, role: str, cores: set[int], *extra: str) -> Proc:
    proc = m.start_worker(role, "--chunked-prefill-size", str(CHUNK), *extra,
                          env={"OMP_NUM_THREADS": str(len(cores)), "OMP_WAIT_POLICY": "PASSIVE",
                               "PDMESH_LOG_LEVEL": "warning"}, wait=False)
    os.sched_setaffinity(proc.popen.pid, cores)  # before torch starts its threads; they inherit it
    return proc


def start_meshes(tmp: pathlib.Path) -> dict:
    m = Launcher(log_dir=tmp)
    p = pinned(m, "prefill", {0})
    d = pinned(m, "decode", {1})
    c = pinned(m, "decode", {0, 1})
    for w in (p, d, c):
        m.wait_healthy(w)
    common = ("--request-timeout", "600", "--log-level", "warning")
    return {
        "mesh": m, "prefill": p,
        "pd": m.start_router([p], [d], *common, "--local-prefill-max-tokens", "0"),  # PD means every request through prefill
        "colocated": m.start_router([], [c], *common, "--mode", "colocated"),
    }


def load(args, base_url: str, workload: str, **kw) -> tuple[dict, list]:
    argv = ["--base-url", base_url, "--workload", workload, "--seed", str(args.seed),
            "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms),
            "--long-len", str(args.long_len), "--long-fraction", str(args.long_fraction), "--drain-timeout", str(args.drain_timeout)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    if args.no_progress:
        argv.append("--no-progress")
    return asyncio.run(serve.run(serve.parser().parse_args(argv)))


def kv_sum_count(prefill: Proc) -> tuple[float, float]:
    m = prefill.metrics()
    return (sum(v for k, v in m.items() if k.startswith("pdmesh:kv_transfer_latency_seconds_sum")),
            sum(v for k, v in m.items() if k.startswith("pdmesh:kv_transfer_latency_seconds_count")))


def kv_share(args, meshes: dict) -> list[dict]:
    rows = []
    for n in (512, 4096):
        for rep in range(args.kv_reps):
            s0, c0 = kv_sum_count(meshes["prefill"])
            summary, _ = load(args, meshes["pd"].http_url, "fixed", input_len=n, output_len=4, num_requests=1,
                              seed=args.seed + rep)
            s1, c1 = kv_sum_count(meshes["prefill"])
            colo, _ = load(args, meshes["colocated"].http_url, "fixed", input_len=n, output_len=4, num_requests=1,
                           seed=args.seed + rep)
            ttft = summary["ttft_ms"]["p50"]
            kv_ms = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
            rows.append({"prompt_tokens": n, "rep": rep, "pd_ttft_ms": ttft, "kv_transfer_ms": kv_ms and round(kv_ms, 3),
                         "kv_share_of_ttft": round(kv_ms / ttft, 5) if kv_ms and ttft else None,
                         "colocated_ttft_ms": colo["ttft_ms"]["p50"]})
            print(f"[kv-share] {rows[-1]}", file=sys.stderr, flush=True)
    return rows


async def _interference(base_url: str, streams: int, long_len: int, delay: float) -> dict:
    """`streams` short requests decode (prompt 32, 400 tokens); after `delay` s one `long_len`
    prompt arrives. ITLs of the short streams, overall and while the long prompt is computed."""
    rng = random.Random(5)
    args = serve.parser().parse_args(["--base-url", base_url])
    specs = [serve.Spec(i, "short", [rng.randrange(32, 127) for _ in range(32)], 400) for i in range(streams)]
    long_spec = serve.Spec(streams, "long", [rng.randrange(32, 127) for _ in range(long_len)], 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        shorts = [asyncio.ensure_future(serve.one(client, args, s, t0, 0.0)) for s in specs]
        await asyncio.sleep(delay)
        long_r = await serve.one(client, args, long_spec, t0, delay)
        results = await asyncio.gather(*shorts)
    window = (delay, delay + (long_r.ttft or 0.0))
    during = [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:], strict=False)
              if window[0] <= b <= window[1]]
    all_itls = [x for r in results for x in r.itls]
    return {"streams": streams, "long_prompt_tokens": long_len, "long_ttft_ms": long_r.ttft and round(long_r.ttft * 1e3, 1),
            "errors": sum(not r.ok for r in results) + (not long_r.ok),
            "itl_ms_all": serve.stats_ms(all_itls), "itl_ms_during_long_prefill": serve.stats_ms(during)}


def interference(args, meshes: dict) -> dict:
    out = {}
    for mode in ("pd", "colocated"):
        out[mode] = asyncio.run(_interference(meshes[mode].http_url, 8, args.interference_len, 3.0))
        meshes["mesh"].assert_invariants(timeout=120)
        print(f"[interference] {mode}: {out[mode]}", file=sys.stderr, flush=True)
    pd, co = out["pd"]["itl_ms_during_long_prefill"], out["colocated"]["itl_ms_during_long_prefill"]
    out["max_itl_during_long_prefill_colocated_over_pd"] = round(co["max"] / pd["max"], 2) if pd["max"] and co["max"] else None
    return out


def goodput_rate(points: list[dict], mode: str, sustained: bool) -> float | None:
    """The highest swept rate with >= 90 % of requests within the SLO; sustained: the highest
    rate up to which every swept point has that (a noisy point below it counts against it)."""
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        if p[mode]["goodput"]["fraction"] >= 0.9:
            best = p["rate"]
        elif sustained:
            break
    return best


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "load_avg_at_start": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.25,0.5,0.75,1", help="mixed-workload request rates (req/s) to sweep")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per load point")
    ap.add_argument("--itl-rate", type=float, default=0.5, help="the load point whose ITLs are compared and plotted")
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--kv-reps", type=int, default=2)
    ap.add_argument("--interference-len", type=int, default=4096,
                    help="the long prompt that arrives while 8 short requests decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-kv", action="store_true")
    ap.add_argument("--out", default="bench/out/pd_vs_colocated.json")
    ap.add_argument("--requests-dir", default="bench/out/serve")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if (os.cpu_count() or 0) < 2:
        print("needs 2 CPU cores (one per PD worker)", file=sys.stderr)
        return 2
    rates = [float(x) for x in args.rates.split(",")]
    if args.itl_rate not in rates:
        rates = sorted({*rates, args.itl_rate})
    req_dir = pathlib.Path(args.requests_dir)
    req_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/pd_vs_colocated.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "split": SPLIT, "chunked_prefill_size": CHUNK,
              "workload": (f"mixed: {1 - args.long_fraction:.0%} short (prompt 16-64, output 256-512), "
                           f"{args.long_fraction:.0%} long (prompt {args.long_len}, output 8)"),
              "slo": {"ttft_ms": args.slo_ttft_ms, "itl_p99_ms": args.slo_itl_ms}, "sweep": []}
    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-") as tmp:
        meshes = start_meshes(pathlib.Path(tmp))
        try:
            for rate in rates:
                point = {"rate": rate, "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
                n = max(8, int(round(rate * args.duration)))
                for mode in ("pd", "colocated"):
                    print(f"[sweep] {mode} rate={rate} n={n}", file=sys.stderr, flush=True)
                    summary, results = load(args, meshes[mode].http_url, "mixed", rate=rate, num_requests=n)
                    summary.pop("config", None)
                    point[mode] = summary
                    if rate == args.itl_rate:
                        path = req_dir / f"mixed_{mode}_rate{rate:g}.json"
                        path.write_text(json.dumps([{**serve.asdict(r), "itls": r.itls} for r in results]))
                        point[mode]["requests_file"] = str(path)
                    meshes["mesh"].assert_invariants(timeout=120)  # drained: the next point starts clean
                report["sweep"].append(point)
                print(f"[sweep] rate={rate}: p99 ITL pd {point['pd']['itl_ms']['p99']} ms, colocated "
                      f"{point['colocated']['itl_ms']['p99']} ms", file=sys.stderr, flush=True)
            report["interference"] = interference(args, meshes)
            if not args.skip_kv:
                report["kv_share"] = kv_share(args, meshes)
        finally:
            meshes["mesh"].close()
    at = next(p for p in report["sweep"] if p["rate"] == args.itl_rate)
    pd99, co99 = at["pd"]["itl_ms"]["p99"], at["colocated"]["itl_ms"]["p99"]
    report["mixed_itl"] = {"rate": args.itl_rate, "pd_p99_ms": pd99, "colocated_p99_ms": co99,
                           "colocated_over_pd": round(co99 / pd99, 3) if pd99 and co99 else None,
                           "pd_p50_ms": at["pd"]["itl_ms"]["p50"], "colocated_p50_ms": at["colocated"]["itl_ms"]["p50"]}
    report["goodput"] = {"rule": "highest swept rate with >= 90 % of requests meeting the SLO; sustained: every "
                                 "lower swept rate meets it too",
                         "slo": report["slo"],
                         **{f"{mode}_req_s": goodput_rate(report["sweep"], mode, False) for mode in ("pd", "colocated")},
                         **{f"{mode}_sustained_req_s": goodput_rate(report["sweep"], mode, True)
                            for mode in ("pd", "colocated")}}
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
