"""Router overhead, printed as JSON: the same requests through the router (HTTP, OpenAI API) and
straight to the workers (gRPC, Prefill + Decode issued together as the router does), in one run.

- added latency: N sequential requests each way, interleaved (router, direct, router, ...) so
  drift hits both alike; p50/p99/mean of each and the differences (router - direct).
- max requests/s: a closed loop of C concurrent clients for S seconds, router vs direct; plus
  the router alone in front of instant fake workers (services/fakes/workers.py), which is
  the router's own ceiling on this machine.

Everything (clients, router, workers) shares this machine's cores, so the absolute numbers are
indicative; the comparison within one run is the point.

Usage: python bench/router_overhead.py [--requests 200] [--concurrency 16] [--seconds 8]
       [--prompt-tokens 32] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import httpx  # noqa: E402

from services.common.generated.pdmesh.v1 import worker_pb2 as wpb  # noqa: E402
from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc  # noqa: E402
from services.launch.launcher import Launcher  # noqa: E402
from services.router.orchestrator import new_room  # noqa: E402

MODEL = "pdmesh-tiny"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(xs, 0.5) * 1000, 3),
        "p99": round(pct(xs, 0.99) * 1000, 3),
        "mean": round(statistics.fmean(xs) * 1000, 3),
    }


class Direct:
    """Prefill + Decode over persistent gRPC channels, exactly as the router issues them."""

    def __init__(self, prefill_addr: str, decode_addr: str):
        self.prefill_addr = prefill_addr
        self.pch = grpc.aio.insecure_channel(prefill_addr)
        self.dch = grpc.aio.insecure_channel(decode_addr)
        self.p = wpb_grpc.PrefillStub(self.pch)
        self.d = wpb_grpc.DecodeStub(self.dch)

    async def one(self, ids: list[int], max_tokens: int) -> int:
        room = new_room()
        params = wpb.SamplingParams(temperature=0, top_p=1, seed=1, max_tokens=max_tokens, ignore_eos=True)
        prefill = asyncio.ensure_future(self.p.Prefill(wpb.PrefillRequest(room=room, token_ids=ids, params=params),
                                                       timeout=60))
        n = 0
        async for chunk in self.d.Decode(wpb.DecodeRequest(room=room, prefill_addr=self.prefill_addr,
                                                           token_ids=ids, params=params), timeout=60):
            n += len(chunk.token_ids)
            if chunk.finish_reason:
                break
        await prefill
        return n

    async def close(self) -> None:
        await self.pch.close()
        await self.dch.close()


class ViaRouter:
    def __init__(self, url: str, concurrency: int):
        self.client = httpx.AsyncClient(base_url=url, timeout=60,
                                        limits=httpx.Limits(max_connections=concurrency + 4))

    async def one(self, prompt_ids: list[int], max_tokens: int) -> int:
        body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "seed": 1,
                "ignore_eos": True}
        resp = await self.client.post("/v1/completions", json=body)
        resp.raise_for_status()
        return resp.json()["usage"]["completion_tokens"]

    async def close(self) -> None:
        await self.client.aclose()


async def latency(router: ViaRouter, direct: Direct, ids: list[int], n: int, max_tokens: int) -> dict:
    for _ in range(5):  # warm-up: connections, first forwards
        await router.one(ids, max_tokens)
        await direct.one(ids, max_tokens)
    r_times, d_times = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        assert await router.one(ids, max_tokens) == max_tokens
        r_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert await direct.one(ids, max_tokens) == max_tokens
        d_times.append(time.perf_counter() - t0)
    r, d = summary_ms(r_times), summary_ms(d_times)
    return {
        "requests_each": n,
        "router_ms": r,
        "direct_ms": d,
        # difference of the percentiles, and percentiles of the per-pair differences (both noisy at p99
        # when client, router and workers share a few cores)
        "added_ms": {k: round(r[k] - d[k], 3) for k in ("p50", "p99", "mean")},
        "paired_added_ms": summary_ms([a - b for a, b in zip(r_times, d_times, strict=True)]),
    }


async def throughput(fn, ids: list[int], max_tokens: int, concurrency: int, seconds: float) -> dict:
    done, errors = 0, 0
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            try:
                await fn(ids, max_tokens)
                done += 1
            except Exception:  # noqa: BLE001 - counted, reported
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {"requests": done, "errors": errors, "seconds": round(elapsed, 2), "rps": round(done / elapsed, 1)}


async def run(args, mesh: Launcher, tmp: pathlib.Path) -> dict:
    (p,), (d,) = mesh.start_workers(1, 1)
    r = mesh.start_router([p], [d], "--log-level", "warning", "--local-prefill-max-tokens", "0")  # its repeated prompt: always PD
    ids = [1] + [(7 * i) % 256 for i in range(args.prompt_tokens - 1)]
    router, direct = ViaRouter(r.http_url, args.concurrency), Direct(p.grpc_addr, d.grpc_addr)
    try:
        out = {"latency": await latency(router, direct, ids, args.requests, args.max_tokens)}
        out["throughput"] = {
            "concurrency": args.concurrency,
            "router": await throughput(router.one, ids, args.max_tokens, args.concurrency, args.seconds),
            "direct": await throughput(direct.one, ids, args.max_tokens, args.concurrency, args.seconds),
        }
    finally:
        await router.close()
        await direct.close()

    # the router's own ceiling: instant fake workers behind it
    fake, fp, fd = mesh.start_fake_workers()
    rproc = mesh.start_router([fp], [fd], "--log-level", "warning")
    try:
        fake_router = ViaRouter(rproc.http_url, args.concurrency)
        try:
            await throughput(fake_router.one, ids, args.max_tokens, args.concurrency, 1.0)  # warm-up
            out["throughput"]["router_on_instant_fake_workers"] = await throughput(
                fake_router.one, ids, args.max_tokens, args.concurrency, args.seconds)
        finally:
            await fake_router.close()
    finally:
        rproc.kill()
        fake.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="sequential requests each way for latency")
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent clients for requests/s")
    ap.add_argument("--seconds", type=float, default=8.0, help="duration of each requests/s run")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        mesh = Launcher(log_dir=pathlib.Path(tmp))
        try:
            result = asyncio.run(run(args, mesh, pathlib.Path(tmp)))
        finally:
            mesh.close()
    result["setup"] = {
        "model": MODEL,
        "device": "cpu",
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "workers": "1 prefill + 1 decode",
        "client": "httpx (router, non-streaming) / grpc.aio (direct), same process",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
