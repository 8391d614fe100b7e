"""Watchdog measurements, printed as JSON.

- eviction latency beyond the deadline (p50/p99 over >= 20 evictions) on an idle prefill and on
  one whose engine is busy with long forwards: a prefill with the stall_transfer fault keeps
  every room in its inflight queue; the worker logs each eviction with its age and deadline.
- CPU used by idle prefill and decode workers over 30 s (/proc/<pid>/stat).
- sweep time with 10,000 entries in the inflight queue (the watchdog's per-tick cost).

Usage: python bench/watchdog.py [--evictions 24] [--idle-seconds 30]
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
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from services.common.sampling_params import SamplingParams  # noqa: E402
from services.fakes.worker_client import generate  # noqa: E402
from services.launch.launcher import Launcher  # noqa: E402
from services.launch.probes import wait_for  # noqa: E402
from services.prefill import watchdog  # noqa: E402
from services.transfer.sender import SenderRoom  # noqa: E402
from services.transfer.state import RoomState, RoomTable  # noqa: E402

INFLIGHT_TIMEOUT = 1.0
WATCHDOG_INTERVAL = 1.0


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def eviction_lags(log_text: str) -> list[float]:
    lags = []
    for line in log_text.splitlines():
        if '"watchdog eviction"' in line:
            rec = json.loads(line)
            lags.append(rec["age_s"] - rec["deadline_s"])
    return lags


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fire(p, d, n: int, prompt_len: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    await asyncio.gather(
        *(generate(p.grpc_addr, d.grpc_addr, [(i + j) % 256 for j in range(prompt_len)], params, timeout=120)
          for i in range(n))
    )


def measure_evictions(mesh: Launcher, n: int, loaded: bool) -> dict:
    prefill_flags = ("--faults", "stall_transfer", "--inflight-timeout", str(INFLIGHT_TIMEOUT),
                     "--watchdog-interval", str(WATCHDOG_INTERVAL), "--chunked-prefill-size", "4096")
    (p,), (d,) = mesh.start_workers(1, 1, prefill_flags)
    if loaded:
        # long prompts keep the engine thread busy (~0.3-1 s forwards) while rooms age in inflight
        asyncio.run(fire(p, d, n, prompt_len=3000))
    else:
        # rooms arrive spread out, the worker otherwise idle
        async def spread():
            tasks = []
            for _ in range(n):
                tasks.append(asyncio.ensure_future(fire(p, d, 1, prompt_len=32)))
                await asyncio.sleep(0.37)
            await asyncio.gather(*tasks)

        asyncio.run(spread())
    wait_for(lambda: len(eviction_lags(p.log())) >= n, 60, "evictions")
    lags = eviction_lags(p.log())
    mesh.assert_invariants()
    p.kill()
    d.kill()
    return {
        "evictions": len(lags),
        "lag_beyond_deadline_p50_s": statistics.median(lags),
        "lag_beyond_deadline_p99_s": percentile(lags, 0.99),
        "lag_beyond_deadline_max_s": max(lags),
        "bound_s": WATCHDOG_INTERVAL,
    }


def measure_idle_cpu(mesh: Launcher, seconds: float) -> dict:
    (p,), (d,) = mesh.start_workers(1, 1)
    asyncio.run(fire(p, d, 1, 32))  # connect the pair once, as in service
    before = {w.role: cpu_seconds(w.popen.pid) for w in (p, d)}
    time.sleep(seconds)  # measuring idleness: nothing to wait on
    used = {role: cpu_seconds(w.popen.pid) - before[role] for role, w in (("prefill", p), ("decode", d))}
    p.kill()
    d.kill()
    return {
        "seconds": seconds,
        **{f"{r}_cpu_s": v for r, v in used.items()},
        **{f"{r}_core_percent": 100 * v / seconds for r, v in used.items()},
    }


def measure_sweep(entries: int) -> dict:
    now = [0.0]
    table: RoomTable[SenderRoom] = RoomTable(lambda: now[0])
    for i in range(entries):
        r = SenderRoom(i, 0.0)
        r.advance(RoomState.WAITING_FOR_INPUT, 0.0)
        r.advance(RoomState.TRANSFERRING, float(i) / entries)
        table.add(r)

    class Counting:  # the sweep's own work, eviction side effects counted only
        def __init__(self):
            # the sender's own sweep (parked attaches, deferred handles) has nothing to do here
            self.sender = type("S", (), {"rooms": table, "sweep": lambda _self: None})()
            self.evicted = 0

        def evict(self, *_a):
            self.evicted += 1

    w = Counting()
    runs = []
    for t, expect in ((0.5, 0), (100.0, entries)):
        now[0] = t
        w.evicted = 0
        t0 = time.perf_counter()
        watchdog.sweep(w, 300.0, 60.0 if expect == 0 else 1.0)
        runs.append(time.perf_counter() - t0)
        assert w.evicted == expect
    return {"entries": entries, "sweep_none_expired_ms": runs[0] * 1e3, "sweep_all_expired_ms": runs[1] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--evictions", type=int, default=24)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    args = ap.parse_args()
    out = {"bench": "watchdog", "inflight_timeout_s": INFLIGHT_TIMEOUT, "watchdog_interval_s": WATCHDOG_INTERVAL}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Launcher(log_dir=pathlib.Path(tmp))
        try:
            out["idle_worker"] = measure_evictions(mesh, args.evictions, loaded=False)
            out["loaded_worker"] = measure_evictions(mesh, args.evictions, loaded=True)
            out["idle_cpu"] = measure_idle_cpu(mesh, args.idle_seconds)
        finally:
            mesh.close()
    out["sweep"] = measure_sweep(10_000)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
