"""Two routers (two source trees) against the same instant fake workers, printed as JSON.

Runs the router of `--old` (a source tree, e.g. `git archive <commit> | tar -x -C DIR`, with its
generated proto code) and the router of this tree alternately, each in its own process in front of
one set of instant fake workers (services/fakes/workers.py), for `--rounds` rounds; each run is a closed
loop of `--concurrency` clients for `--seconds` seconds. The medians of the rounds are compared
(new / old): a restructure must not cost throughput (new >= 0.95 x old). Everything
shares this machine's cores, so run it on an otherwise idle machine and look at the ratio only.
Each run also reports the router process's CPU time per request (user + system, from
/proc/PID/stat over the measured seconds): on a machine busy with other work requests/s swings
with what else runs, while CPU per request moves much less, so compare that ratio there.

Usage: python bench/router_ab.py --old DIR [--rounds 3] [--seconds 4] [--concurrency 16] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.router_overhead import ViaRouter, throughput  # noqa: E402
from services.launch.launcher import Launcher  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(tree: pathlib.Path, fp: str, fd: str, args, log_dir: pathlib.Path) -> tuple[float, float]:
    """(requests/s, router CPU µs per request) of the router of source tree `tree` in front of the
    fakes, started by services/launch from that tree, measured, stopped."""
    log_dir.mkdir()
    launcher = Launcher(log_dir=log_dir)
    try:
        router = launcher.start_router([fp], [fd], "--log-level", "warning", cwd=tree)
        client = ViaRouter(router.http_url, args.concurrency)
        ids = [1] + [(7 * i) % 256 for i in range(args.prompt_tokens - 1)]
        try:
            await throughput(client.one, ids, args.max_tokens, args.concurrency, 1.0)  # warm-up
            cpu0 = cpu_seconds(router.popen.pid)
            out = await throughput(client.one, ids, args.max_tokens, args.concurrency, args.seconds)
            cpu = cpu_seconds(router.popen.pid) - cpu0
        finally:
            await client.close()
        if out["errors"]:
            raise RuntimeError(f"{out['errors']} failed requests through the router of {tree}")
        return out["rps"], round(cpu / max(1, out["requests"]) * 1e6, 1)
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
            cpu: dict[str, list[float]] = {"old": [], "new": []}
            for i in range(args.rounds):  # alternating, so drift hits both alike
                for name, tree in (("old", old), ("new", ROOT)):
                    r, c = await one_run(tree, fp, fd, args, tmp / f"{name}-{i}")
                    rps[name].append(r)
                    cpu[name].append(c)
        finally:
            fakes.stop()
    med = {k: statistics.median(v) for k, v in rps.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"concurrency": args.concurrency, "seconds": args.seconds, "max_tokens": args.max_tokens,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "rps": rps, "median_rps": med, "new_over_old": round(med["new"] / med["old"], 3),
            "cpu_us_per_request": cpu, "median_cpu_us_per_request": med_cpu,
            "cpu_new_over_old": round(med_cpu["new"] / med_cpu["old"], 3)}


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
