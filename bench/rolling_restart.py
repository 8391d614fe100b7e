"""A rolling restart of every role under steady load, as processes: zero failed requests and zero
broken streams is the bar. Prints (and writes) JSON.

The mesh: 2 prefill, 2 decode, 2 routers (real processes, built-in model). Client threads send
completions back to back (every other one streamed), each to a router of the rotation, the
way a Kubernetes Service spreads connections over ready pods. Then, one process at a time:

- router: it leaves the rotation (readiness dropped / endpoint removed), `--pre-stop` seconds
  pass (the manifests' preStop), SIGTERM; it finishes what it holds and exits; a new router
  joins the rotation once its /health is 200;
- prefill, then decode: SIGTERM (the worker drains: NOT_SERVING, the routers eject it, a decode's
  streams migrate); once it exited a new process starts on the same ports (loading, then
  serving) and the next one goes only when both routers admitted it again.

A request fails when its status is not 200 or (streamed) it carries an error event or misses
`data: [DONE]`. Afterwards every queue is 0 and every KV page free on the survivors.

Usage: python bench/rolling_restart.py [--clients 4] [--max-tokens 24] [--out bench/out/rolling_restart.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from services.launch.launcher import Launcher  # noqa: E402
from services.launch.probes import scrape_metrics, wait_for  # noqa: E402
from services.launch.proc import Proc  # noqa: E402

MODEL = "pdmesh-tiny"
ROUTER_FLAGS = ("--health-check-interval", "0.5", "--health-check-timeout", "0.5", "--shutdown-timeout", "30")


class Rotation:
    """The routers clients may pick (what a Service's endpoints hold), round robin."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.urls: list[str] = []
        self._next = itertools.count()

    def add(self, url: str) -> None:
        with self.lock:
            self.urls.append(url)

    def remove(self, url: str) -> None:
        with self.lock:
            self.urls.remove(url)

    def pick(self) -> str:
        with self.lock:
            return self.urls[next(self._next) % len(self.urls)]


class Load:
    def __init__(self, rotation: Rotation, clients: int, max_tokens: int):
        self.rotation, self.max_tokens = rotation, max_tokens
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        for n in itertools.count():
            if self.stopping.is_set():
                return
            stream = (n + i) % 2 == 0
            url = self.rotation.pick()
            body = {"model": MODEL, "prompt": f"client {i} request {n}", "max_tokens": self.max_tokens,
                    "ignore_eos": True, "stream": stream}
            t0 = time.monotonic()
            try:
                # a new connection each time: a removed router gets no request after it left the rotation
                resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
                text = resp.text
                ok = resp.status_code == 200 and (not stream or ('data: {"error"' not in text
                                                                 and text.endswith("data: [DONE]\n\n")))
                detail = "" if ok else f"{resp.status_code} {text[-400:]}"
            except httpx.HTTPError as e:
                ok, detail = False, repr(e)
            with self.lock:
                self.results.append({"start": t0, "end": time.monotonic(), "ok": ok, "stream": stream,
                                     "router": url, "detail": detail})

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(90)


def migrations(router: Proc) -> float:
    m = scrape_metrics(router.http_url)
    return sum(v for k, v in m.items() if k.startswith("pdmesh:router_migrations_total"))


def restart_worker(mesh: Launcher, old: Proc, routers: list[Proc]) -> Proc:
    old.popen.send_signal(signal.SIGTERM)
    old.popen.wait(timeout=90)
    mesh.procs.remove(old)
    new = mesh.spawn(old.role, list(old.args), old.http_port, old.grpc_port, None)
    mesh.wait_healthy(new, timeout=120)

    def admitted_by_all() -> bool:
        for r in routers:
            pool = httpx.get(r.http_url + "/health", timeout=5).json()
            if not pool[new.role].get(new.grpc_addr, {}).get("healthy"):
                return False
        return True

    wait_for(admitted_by_all, 30, f"every router to admit the new {new.role}")
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--pre-stop", type=float, default=1.0, help="seconds between leaving the rotation and SIGTERM")
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of load before and after the restarts")
    ap.add_argument("--out", default="bench/out/rolling_restart.json")
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pdmesh-rolling-"))
    mesh = Launcher(log_dir=tmp)
    events: list[dict] = []
    t_start = time.monotonic()

    def event(what: str) -> None:
        events.append({"t": round(time.monotonic() - t_start, 2), "event": what})
        print(f"[{events[-1]['t']:7.2f}s] {what}", file=sys.stderr, flush=True)

    try:
        prefills, decodes = mesh.start_workers(2, 2)
        routers = [mesh.start_router(prefills, decodes, *ROUTER_FLAGS) for _ in range(2)]
        for r in routers:
            wait_for(lambda r=r: httpx.get(r.http_url + "/health", timeout=5).json()["status"] == "ok", 30,
                     "router ready")
        rotation = Rotation()
        for r in routers:
            rotation.add(r.http_url)
        load = Load(rotation, args.clients, args.max_tokens)
        event("load started")
        time.sleep(args.steady)
        migrated = 0.0

        for i, old in enumerate(list(routers)):
            new = mesh.start_router(prefills, decodes, *ROUTER_FLAGS)
            rotation.add(new.http_url)
            event(f"router {i}: new one in the rotation")
            rotation.remove(old.http_url)
            time.sleep(args.pre_stop)
            migrated += migrations(old)
            old.popen.send_signal(signal.SIGTERM)
            old.popen.wait(timeout=60)
            mesh.procs.remove(old)
            routers[routers.index(old)] = new
            event(f"router {i}: old one stopped (exit {old.popen.returncode})")
        for role, group in (("prefill", prefills), ("decode", decodes)):
            for i, old in enumerate(list(group)):
                event(f"{role} {i}: SIGTERM")
                group[i] = restart_worker(mesh, old, routers)
                event(f"{role} {i}: restarted and admitted by both routers")
        time.sleep(args.steady)
        load.stop()
        event("load stopped")
        migrated += sum(migrations(r) for r in routers)
        mesh.assert_invariants()
        event("invariants hold: queues 0, pages free")

        res = load.results
        failed = [r for r in res if not r["ok"]]
        lat = sorted(r["end"] - r["start"] for r in res if r["ok"])
        report = {
            "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
            "clients": args.clients, "max_tokens": args.max_tokens, "pre_stop_s": args.pre_stop,
            "duration_s": round(res[-1]["end"] - res[0]["start"], 1) if res else 0,
            "requests": len(res), "streams": sum(r["stream"] for r in res),
            "failed_requests": len(failed),
            "broken_streams": sum(1 for r in failed if r["stream"]),
            "migrations": migrated,
            "latency_s": {"p50": round(statistics.median(lat), 3), "p99": round(lat[int(0.99 * (len(lat) - 1))], 3),
                          "max": round(lat[-1], 3)} if lat else {},
            "failures": [r["detail"] for r in failed[:10]],
            "events": events,
        }
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k != "events"}, indent=2))
    finally:
        mesh.close()


if __name__ == "__main__":
    main()
