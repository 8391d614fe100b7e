"""Start real pdmesh processes for integration tests and check the invariants after each scenario.

Every process gets free 127.0.0.1 ports, its own log file, and is killed by `Mesh.close()`
(use the `mesh` fixture from tests/integration/conftest.py, which always closes).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.launch.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]

QUEUE_GAUGES = {
    "prefill": (
        "pdmesh:num_prefill_prealloc_queue_reqs",
        "pdmesh:num_prefill_inflight_queue_reqs",
        "pdmesh:num_queue_reqs",
        "pdmesh:num_running_reqs",
    ),
    "decode": (
        "pdmesh:num_decode_prealloc_queue_reqs",
        "pdmesh:num_decode_transfer_queue_reqs",
        "pdmesh:num_running_reqs",
        "pdmesh:num_retracted_reqs",
    ),
}


def scrape_metrics(base_url: str) -> dict[str, float]:
    """Samples of base_url/metrics by name (labels dropped but `queue`; one worker per process)."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name if not s.labels.get("queue") else f"{s.name}{{queue={s.labels['queue']}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def labelled_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` in a Prometheus text exposition."""
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def attempts_in_log(log_text: str) -> list[tuple[str, str]]:
    """(prefill, decode) of every attempt a router's JSON log records, in order."""
    pairs = []
    for line in log_text.splitlines():
        if '"attempt"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "attempt":
            pairs.append((event["prefill"], event["decode"]))
    return pairs


def wait_for(cond: Callable[[], object], timeout: float, what: str, poll: float = 0.02):
    """Wait until cond() is truthy (returns it); fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except AssertionError:
            raise  # the condition itself decided the wait is hopeless (e.g. the process died)
        except Exception as e:  # noqa: BLE001 - the condition may fail until the service is up
            last_exc = e
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def in_background(fn: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Run fn() on a thread; its result lands in box["out"] (the test waits on the thread)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    thread.start()
    return thread, box


@dataclass
class Proc:
    role: str  # prefill | decode | router
    popen: subprocess.Popen
    log_path: pathlib.Path
    http_port: int
    grpc_port: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.http_url)

    def health(self) -> dict:
        return httpx.get(self.http_url + "/health", timeout=5).json()

    def stop(self) -> None:
        os.kill(self.popen.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            try:
                os.kill(self.popen.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            except ProcessLookupError:
                pass
            self.popen.kill()
        self.popen.wait(timeout=10)


class Mesh:
    def __init__(self, tmp_path: pathlib.Path):
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []
        self._spawned = 0

    def _spawn(self, role: str, args: list[str], http_port: int, grpc_port: int | None, env: dict | None) -> Proc:
        self._spawned += 1  # a restarted process gets a log of its own
        log_path = self.tmp_path / f"{role}-{self._spawned}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{role}", *args],
            cwd=ROOT,
            env=full_env,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = Proc(role, popen, log_path, http_port, grpc_port, args)
        self.procs.append(proc)
        return proc

    def start_worker(self, role: str, *extra: str, env: dict | None = None, wait: bool = True) -> Proc:
        grpc_port, http_port = free_port(), free_port()
        args = ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--device", "cpu", *extra]
        proc = self._spawn(role, args, http_port, grpc_port, env)
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_prefill(self, *extra: str, **kw) -> Proc:
        return self.start_worker("prefill", *extra, **kw)

    def start_decode(self, *extra: str, **kw) -> Proc:
        return self.start_worker("decode", *extra, **kw)

    def restart(self, proc: Proc, wait: bool = True, drop_flags: tuple[str, ...] = (),
                add_args: tuple[str, ...] = ()) -> Proc:
        """Kill and start the same role on the same ports (a new epoch), with the same flags
        except `drop_flags` (each removed with its value, e.g. "--faults"), plus `add_args`."""
        proc.kill()
        self.procs.remove(proc)
        args = list(proc.args)
        for flag in drop_flags:
            while flag in args:
                i = args.index(flag)
                del args[i : i + 2]
        new = self._spawn(proc.role, [*args, *add_args], proc.http_port, proc.grpc_port, None)
        if wait:
            self.wait_healthy(new)
        return new

    def start_router(
        self, prefills: list[Proc | str], decodes: list[Proc | str], *extra: str, env: dict | None = None,
        wait: bool = True,
    ) -> Proc:
        """Workers as processes (their gRPC address) or as address specs (e.g. a host name);
        `wait`: until its /health is 200."""
        port = free_port()
        args = ["--port", str(port)]
        for p in prefills:
            args += ["--prefill", p if isinstance(p, str) else p.grpc_addr]
        for d in decodes:
            args += ["--decode", d if isinstance(d, str) else d.grpc_addr]
        proc = self._spawn("router", [*args, *extra], port, None, env)
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_workers(self, prefills: int, decodes: int, prefill_flags: tuple[str, ...] = (),
                      decode_flags: tuple[str, ...] = ()) -> tuple[list[Proc], list[Proc]]:
        """Start the workers side by side (models load in parallel), then wait for all of them."""
        ps = [self.start_prefill(*prefill_flags, wait=False) for _ in range(prefills)]
        ds = [self.start_decode(*decode_flags, wait=False) for _ in range(decodes)]
        for w in (*ps, *ds):
            self.wait_healthy(w)
        return ps, ds

    def wait_healthy(self, proc: Proc, timeout: float = 90) -> None:
        def ok():
            if not proc.alive():
                raise AssertionError(f"{proc.role} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
            return httpx.get(proc.http_url + "/health", timeout=2).status_code == 200

        wait_for(ok, timeout, f"{proc.role} on :{proc.http_port} to become healthy")

    def assert_invariants(self, timeout: float = 10) -> None:
        """All queue gauges 0 and every KV pool whole, on every live worker."""
        for proc in self.procs:
            if proc.role not in QUEUE_GAUGES or not proc.alive():
                continue

            def settled(proc=proc):
                m = proc.metrics()
                h = proc.health()
                nonzero = {g: m.get(g) for g in QUEUE_GAUGES[proc.role] if m.get(g, 0) != 0}
                return not nonzero and h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]

            wait_for(settled, timeout, f"{proc.role} {proc.grpc_addr}: queue gauges 0 and KV pool whole")

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - best effort, keep killing the others
                pass
        self.procs.clear()
