"""Start pdmesh processes on the hosts of a `Topology` (services/launch/netns.py): each inside its
host's network namespace, with its own IPC/UTS namespaces and hostname, bound to the host's
address. The test process reaches their HTTP ports from an observer host through `NsThread`.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.launch.netns import NsThread, Topology
from tests.integration.mesh import QUEUE_GAUGES, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRPC_PORT = {"prefill": 50051, "decode": 50052}
HTTP_PORT = {"prefill": 8081, "decode": 8082, "router": 8000}

# The transfer settings of a real network (docs/transfer.md "Across hosts"): a partitioned
# peer's WRITE fails in seconds, not after Linux's TCP retries (minutes).
HOST_ENV = {"PDMESH_TRANSFER_TCP_USER_TIMEOUT": "5"}


@dataclass
class HostProc:
    role: str
    host: str
    addr: str
    popen: subprocess.Popen
    log_path: pathlib.Path
    args: list[str]
    obs: NsThread
    http_port: int
    env: dict = field(default_factory=dict)

    @property
    def grpc_addr(self) -> str:
        return f"{self.addr}:{GRPC_PORT[self.role]}" if self.role in GRPC_PORT else ""

    @property
    def http_url(self) -> str:
        return f"http://{self.addr}:{self.http_port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 5) -> httpx.Response:
        return self.obs.call(httpx.get, self.http_url + path, timeout=timeout)

    def post(self, path: str, json: dict, timeout: float = 60, headers: dict | None = None) -> httpx.Response:
        return self.obs.call(httpx.post, self.http_url + path, json=json, timeout=timeout, headers=headers)

    def health(self) -> dict:
        return self.get("/health").json()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.get("/metrics").text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> None:
        os.kill(self.popen.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            try:
                os.kill(self.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.popen.kill()
        self.popen.wait(timeout=10)


class HostMesh:
    def __init__(self, topo: Topology, tmp_path: pathlib.Path, observer: str = "observer", env: dict | None = None):
        self.topo, self.tmp_path = topo, tmp_path
        self.obs = NsThread(topo.ns(observer))
        self.env = {**HOST_ENV, **(env or {})}
        self.procs: list[HostProc] = []
        self._spawned = 0  # a restarted process gets a log of its own

    def _spawn(self, role: str, host: str, args: list[str], env: dict | None, http_port: int) -> HostProc:
        self._spawned += 1
        log_path = self.tmp_path / f"{role}-{host}-{self._spawned}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        cmd = self.topo.wrap(host, [sys.executable, "-m", f"services.{role}", *args])
        popen = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_path.open("wb"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
        proc = HostProc(role, host, self.topo.addr(host), popen, log_path, args, self.obs, http_port, env or {})
        self.procs.append(proc)
        return proc

    def start_worker(self, role: str, host: str, *extra: str, env: dict | None = None, wait: bool = True) -> HostProc:
        addr = self.topo.addr(host)
        args = ["--host", addr, "--grpc-port", str(GRPC_PORT[role]), "--http-port", str(HTTP_PORT[role]),
                "--device", "cpu", "--num-pages", "512", "--worker-id", f"{role}-{host}", *extra]
        proc = self._spawn(role, host, args, env, HTTP_PORT[role])
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_router(self, host: str, prefills: list[HostProc], decodes: list[HostProc], *extra: str,
                     port: int = 8000, env: dict | None = None) -> HostProc:
        args = ["--host", self.topo.addr(host), "--port", str(port)]
        for p in prefills:
            args += ["--prefill", p.grpc_addr]
        for d in decodes:
            args += ["--decode", d.grpc_addr]
        proc = self._spawn("router", host, [*args, *extra], env, port)
        self.wait_healthy(proc)
        return proc

    def restart(self, proc: HostProc, wait: bool = True, drop_flags: tuple[str, ...] = (),
                add_args: tuple[str, ...] = ()) -> HostProc:
        """Kill `proc` and start the same role on the same host, address and ports (a new epoch,
        fresh IPC/UTS namespaces), with the same flags except `drop_flags` (each removed with its
        value), plus `add_args`."""
        proc.kill()
        self.procs.remove(proc)
        args = list(proc.args)
        for flag in drop_flags:
            while flag in args:
                i = args.index(flag)
                del args[i : i + 2]
        new = self._spawn(proc.role, proc.host, [*args, *add_args], proc.env, proc.http_port)
        if wait:
            self.wait_healthy(new)
        return new

    def wait_healthy(self, proc: HostProc, timeout: float = 120) -> None:
        def ok():
            if not proc.alive():
                raise AssertionError(f"{proc.role}@{proc.host} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
            return proc.get("/health", timeout=2).status_code == 200

        wait_for(ok, timeout, f"{proc.role} on {proc.host} to become healthy", poll=0.1)

    def assert_invariants(self, timeout: float = 15, procs: list[HostProc] | None = None) -> None:
        """Queue gauges 0, every KV pool whole, no live NIXL handle, on every live worker."""
        for proc in procs or self.procs:
            if proc.role not in QUEUE_GAUGES or not proc.alive():
                continue

            def settled(proc=proc):
                m, h = proc.metrics(), proc.health()
                nonzero = {g: m.get(g) for g in QUEUE_GAUGES[proc.role] if m.get(g, 0) != 0}
                return (not nonzero and h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]
                        and h["nixl_live_handles"] == 0 and h["rooms"] == 0)

            wait_for(settled, timeout, f"{proc.role}@{proc.host}: gauges 0, pool whole, no NIXL handle", poll=0.1)

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - keep killing the others
                pass
        self.procs.clear()
        self.obs.close()
