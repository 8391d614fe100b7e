"""Two routers (two source trees) against the same instant fake workers, printed as JSON.

Runs the router of `--old` (a source tree, e.g. `git archive <commit> | tar -x -C DIR`, with its
generated proto code) and the router of this tree alternately, each in its own process in front of
one set of instant fake workers (services/fakes/workers.py), for `--rounds` rounds; each run is a closed
loop of `--concurrency` clients for `--seconds` seconds. The medians of the rounds are compared
(new / old): a restructure must not cost throughput (new >= 0.95 x old). Everything
shares this machine's cores, so run it on an otherwise idle machine and look at the ratio only.

Usage: python bench/router_ab.py --old DIR [--rounds 3] [--seconds 4] [--concurrency 16] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.router_overhead import ViaRouter, throughput  # noqa: E402
from services.launch.launcher import Launcher  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


async def one_run(tree: pathlib.Path, fp: str, fd: str, args, log_dir: pathlib.Path) -> float:
    """The router of source tree `tree` in front of the fakes, started by services/launch from
    that tree, measured, stopped."""
    log_dir.mkdir()
    launcher = Launcher(log_dir=log_dir)
    try:
        router = launcher.start_router([fp], [fd], "--log-level", "warning", cwd=tree)
        client = ViaRouter(router.http_url, args.concurrency)
        ids = [1] + [(7 * i) % 256 for i in range(args.prompt_tokens - 1)]
        try:
            await throughput(client.one, ids, args.max_tokens, args.concurrency, 1.0)  # warm-up
            out = await throughput(client.one, ids, args.max_tokens, args.concurrency, args.seconds)
        finally:
            await client.close()
        if out["errors"]:
            raise RuntimeError(f"{out['errors']} failed requests through the router of {tree}")
        return out["rps"]
    finally:
        launcher.stop()


async def main_async(args) -> dict:
    old = pathlib.Path(args.old).resolve()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        fakes = Launcher(log_dir=tmp)
        _, fp, fd = fakes.start_fake_workers()
        try:
            rps: dict[str, list[float]] = {"old": [], "new": []}
            for i in range(args.rounds):  # alternating, so drift hits both alike
                rps["old"].append(await one_run(old, fp, fd, args, tmp / f"old-{i}"))
                rps["new"].append(await one_run(ROOT, fp, fd, args, tmp / f"new-{i}"))
        finally:
            fakes.stop()
    med = {k: statistics.median(v) for k, v in rps.items()}
    return {"concurrency": args.concurrency, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "rps": rps, "median_rps": med, "new_over_old": round(med["new"] / med["old"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other router's source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=2))


if __name__ == "__main__":
    main()
