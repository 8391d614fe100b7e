"""Well-behaved clients next to hostile ones, printed as JSON: what a hostile load costs the others.

One prefill, one decode and one router (real processes, default flags but those given). 16
well-behaved clients stream completions in a closed loop; their end-to-end latency (p50, p99) is
measured alone, then next to each hostile load, in one run:

- `header_only`: 300 connections that send a request's headers and never its body (each
  reopened as soon as the router closes it, so 300 are always there);
- `stop_reading`: 32 clients that start a stream on a socket with a 4 KB receive buffer and
  never read it (each restarted once the router cuts it off).

`ratio` is a phase's p99 over the p99 alone. Everything shares this machine's cores, so the
absolute numbers are indicative; the comparison within one run is the point.

Usage: python bench/hostile.py [--seconds 20] [--clients 16] [--max-tokens 32]
       [--router-flag=--client-write-timeout=5 ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from services.launch.launcher import Launcher  # noqa: E402

MODEL = "pdmesh-tiny"
HEADER_ONLY, STOP_READING = 300, 32


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def well_behaved(url: str, clients: int, seconds: float, max_tokens: int) -> dict:
    """`clients` closed-loop streaming clients for `seconds`: latency summary and failures."""
    latencies: list[float] = []
    failures: list[str] = []
    until = time.monotonic() + seconds
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def loop() -> None:
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < until:
                t = time.monotonic()
                try:
                    with client.stream("POST", url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            failures.append(str(resp.status_code))
                            continue
                        for _ in resp.iter_lines():
                            pass
                    latencies.append(time.monotonic() - t)
                except httpx.HTTPError as e:
                    failures.append(type(e).__name__)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(seconds + 120)
    out = {"requests": len(latencies), "failures": len(failures)}
    if latencies:
        out.update(p50_ms=round(pct(latencies, 0.5) * 1000, 1), p99_ms=round(pct(latencies, 0.99) * 1000, 1),
                   mean_ms=round(statistics.fmean(latencies) * 1000, 1))
    return out


class Hostile:
    """`count` hostile connections kept open by one thread each, each reopened when it is closed."""

    def __init__(self, port: int, count: int, request: bytes, rcvbuf: int | None):
        self.port, self.request, self.rcvbuf = port, request, rcvbuf
        self.stop = threading.Event()
        self.reopened = 0
        self.threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(count)]
        for th in self.threads:
            th.start()

    def _hold(self) -> None:
        while not self.stop.is_set():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                if self.rcvbuf is not None:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
                s.connect(("127.0.0.1", self.port))
                s.sendall(self.request)
                s.settimeout(0.5)
                while not self.stop.is_set():  # until the router closes it (FIN) or cuts it (RST)
                    try:
                        data = s.recv(1, socket.MSG_PEEK)
                    except TimeoutError:
                        continue
                    if data == b"":
                        break
                    if self.rcvbuf is None:
                        s.recv(65536)  # header-only: read the 408; the close follows
                    else:
                        self.stop.wait(0.5)  # stop-reading: what came stays unread
            except OSError:
                pass
            finally:
                s.close()
            self.reopened += 1

    def close(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(5)


def head(port: int, length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--router-flag", action="append", default=[],
                    help="extra router flag, e.g. --router-flag=--client-write-timeout=5")
    args = ap.parse_args(argv)
    extra = [part for flag in args.router_flag for part in flag.split("=", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        m = Launcher(log_dir=pathlib.Path(tmp))
        try:
            (p,), (d,) = m.start_workers(1, 1)
            r = m.start_router([p], [d], *extra)
            stream = json.dumps({"model": MODEL, "prompt": "tell me a long story", "max_tokens": 4000,
                                 "ignore_eos": True, "logprobs": 20, "stream": True}).encode()
            loads = {
                "header_only": (HEADER_ONLY, head(r.http_port, 100), None),
                "stop_reading": (STOP_READING, head(r.http_port, len(stream)) + stream, 4096),
            }
            well_behaved(r.http_url, args.clients, 2.0, args.max_tokens)  # warm-up
            phases = {"alone": well_behaved(r.http_url, args.clients, args.seconds, args.max_tokens)}
            for name, (count, request, rcvbuf) in loads.items():
                hostile = Hostile(r.http_port, count, request, rcvbuf)
                time.sleep(1.0)  # the hostile connections are in before the measurement starts
                try:
                    phases[name] = well_behaved(r.http_url, args.clients, args.seconds, args.max_tokens)
                finally:
                    hostile.close()
                phases[name]["hostile_connections_reopened"] = hostile.reopened
            alone = phases["alone"].get("p99_ms")
            for name in loads:
                p99 = phases[name].get("p99_ms")
                phases[name]["ratio"] = round(p99 / alone, 2) if alone and p99 else None
            print(json.dumps({"clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
                              "router_flags": extra, "phases": phases}, indent=2))
        finally:
            m.close()


if __name__ == "__main__":
    main()
