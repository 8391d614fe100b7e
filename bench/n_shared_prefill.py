"""n = 4 on a long prompt: the prompt computed once (shared prefill) against four times (fan-out
of independent requests, what the router did before), printed as JSON.

A real mesh (1 prefill, 1 decode, router; random built-in model, byte tokens). Each run draws a
fresh prompt of `--prompt-tokens` bytes and measures, interleaved:

- `shared`: one streamed request with n = 4 (services/prefill/sharing.py: one choice computes,
  three take its full pages from the prefix cache and compute only the last partial page);
- `fanout`: four concurrent streamed n = 1 requests with seeds seed + i — exactly the requests
  the router's fan-out sent before the prompt was shared.

Per run: `ttft_ms`, until every choice has its first token (an n = 4 stream starts only then),
and the growth of prefill's `prompt_tokens_total` (tokens a forward computed) and
`shared_prompt_tokens_total` (tokens a choice took from the one that computed them). Medians over
`--runs`. Everything shares this machine's cores: compare within one run.

Usage: python bench/n_shared_prefill.py [--prompt-tokens 2048] [--runs 5] [--n 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from services.launch.launcher import Launcher  # noqa: E402

MODEL = "builtin-random"


async def first_tokens(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Stream one request to the end; seconds until its first content-bearing event."""
    t0, first = time.monotonic(), None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - t0
    return first


async def fanout_run(url: str, prompt: str, n: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        ttfts = await asyncio.gather(*(first_tokens(client, url, {**body, "seed": 1000 + i}) for i in range(n)))
    return max(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=4)
    args = ap.parse_args()
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {k: {"ttft_ms": [], "computed": [], "shared": []}
                                                  for k in ("shared", "fanout")}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Launcher(log_dir=pathlib.Path(tmp))
        try:
            model = ("--model", MODEL)
            (p,), (d,) = mesh.start_workers(1, 1, model, model)
            r = mesh.start_router([p], [d], *model, "--request-timeout", "600")
            asyncio.run(fanout_run(r.http_url, "warm up", 1))
            for _ in range(args.runs):
                for kind in ("fanout", "shared"):
                    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.prompt_tokens))
                    before = p.metrics()
                    if kind == "shared":
                        ttft = asyncio.run(first_tokens_n(r.http_url, prompt, args.n))
                    else:
                        ttft = asyncio.run(fanout_run(r.http_url, prompt, args.n))
                    after = p.metrics()
                    res = results[kind]
                    res["ttft_ms"].append(round(ttft * 1000, 1))
                    res["computed"].append(after["pdmesh:prompt_tokens_total"] - before["pdmesh:prompt_tokens_total"])
                    res["shared"].append(after["pdmesh:shared_prompt_tokens_total"]
                                         - before["pdmesh:shared_prompt_tokens_total"])
            mesh.assert_invariants()
        finally:
            mesh.close()
    out = {"prompt_tokens": args.prompt_tokens, "n": args.n, "runs": args.runs}
    for kind, res in results.items():
        out[kind] = {
            "ttft_ms_median": statistics.median(res["ttft_ms"]),
            "ttft_ms": res["ttft_ms"],
            "prompt_tokens_computed_median": statistics.median(res["computed"]),
            "prompt_tokens_shared_median": statistics.median(res["shared"]),
        }
    out["ttft_speedup"] = round(out["fanout"]["ttft_ms_median"] / out["shared"]["ttft_ms_median"], 2)
    print(json.dumps(out, indent=2))


async def first_tokens_n(url: str, prompt: str, n: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 1000, "ignore_eos": True,
            "n": n}
    async with httpx.AsyncClient(timeout=600) as client:
        return await first_tokens(client, url, body)


if __name__ == "__main__":
    main()
