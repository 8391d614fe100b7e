"""The KV checksum's cost, printed as JSON (docs/bench.md, "KV checksum").

1. Hashing alone: XXH3-64 over a room's KV pages in a real KVPool (built-in model, float32,
   32 KiB pages), for rooms of 64 KiB, 1 MiB and 64 MiB, pages contiguous and scattered; median of
   5, in GB/s. Decode hashes the same bytes again on arrival.
2. Through the mesh: 1 prefill + 1 decode + router, `--kv-checksum on` against `off`, alternating
   runs, distinct prompts (no prefix-cache hit) whose KV is 64 KiB and 1 MiB; the median latency of
   one-token requests (TTFT + one token), and the ratio on/off.

Usage: python bench/kv_checksum.py [--runs 3] [--requests 12]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from services.launch.launcher import Launcher  # noqa: E402
from services.transfer.kv_checksum import kv_checksum  # noqa: E402

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20}


def hashing() -> dict:
    from services.engine.kv_pool import KVPool
    from services.engine.loader import load_model

    model = load_model(None)
    pool = KVPool(model.config, num_pages=2048 + 64, page_size=16)
    pool.kv.normal_()
    out = {"page_bytes": pool.page_nbytes}
    rng = random.Random(0)
    for name, size in SIZES.items():
        n = size // pool.page_nbytes
        layouts = {"contiguous": list(range(n)), "scattered": rng.sample(range(pool.num_pages), n)}
        for layout, pages in layouts.items():
            times = []
            for _ in range(5):
                t = time.perf_counter()
                kv_checksum(pool.page_run_bytes, pages, [1, 2, 3, 4, 5, 6])
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            out[f"{name}_{layout}"] = {"ms": round(med * 1e3, 3), "GB_s": round(size / med / 1e9, 2)}
    return out


def mesh_run(tmp: pathlib.Path, checksum: str, tokens: int, requests: int, salt: int) -> float:
    m = Launcher(log_dir=tmp)
    try:
        (p,), (d,) = m.start_workers(1, 1, ("--kv-checksum", checksum), ("--kv-checksum", checksum))
        r = m.start_router([p], [d])
        lat = []
        for i in range(requests + 1):
            ids = [(salt * 7919 + i * 131 + k * 17) % 2000 + 10 for k in range(tokens)]
            t = time.perf_counter()
            resp = httpx.post(r.http_url + "/v1/completions", timeout=120, json={
                "model": "pdmesh-tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
            assert resp.status_code == 200, resp.text
            if i:  # the first one warms the path
                lat.append(time.perf_counter() - t)
        return statistics.median(lat)
    finally:
        m.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args()
    import tempfile

    report = {"hashing": hashing(), "mesh": {}}
    for name, tokens in (("64KiB", 32), ("1MiB", 512)):
        on, off = [], []
        for run in range(args.runs):  # alternate so that the machine's load hits both alike
            for checksum, into in (("on", on), ("off", off)):
                with tempfile.TemporaryDirectory() as tmp:
                    into.append(mesh_run(pathlib.Path(tmp), checksum, tokens, args.requests, run))
        report["mesh"][name] = {
            "prompt_tokens": tokens, "median_s_on": round(statistics.median(on), 4),
            "median_s_off": round(statistics.median(off), 4),
            "ratio_on_off": round(statistics.median(on) / statistics.median(off), 3), "runs": args.runs}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
