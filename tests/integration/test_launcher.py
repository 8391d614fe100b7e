"""services/launch: a mesh started from a spec serves a request and leaves nothing behind.

- `Launcher(spec)` as a context manager: 1 prefill + 1 decode + a router, both workers SERVING
  on gRPC health, one completion through the router, then every process gone and every port
  free again;
- the fake workers (services/fakes/workers.py) behind a real router, as the router benches run
  them: SERVING, one request served, all stopped;
- a service that cannot start fails `start()` with its log, and the services already started
  are stopped;
- `make run`'s launcher (services/mesh.py) SIGKILLed: its services die with it (parent-death
  signal) and free the ports.
"""

from __future__ import annotations

import signal
import socket

import httpx
import pytest

from services.launch.launcher import Launcher
from services.launch.ports import free_port
from services.launch.probes import http_healthy, wait_for
from services.launch.proc import service_command, spawn
from services.launch.spec import MeshSpec, Service

pytestmark = pytest.mark.integration


def port_free(port: int) -> bool:
    """Nothing listens on the port (connections in TIME_WAIT, which a restarted service's
    SO_REUSEADDR bind ignores, do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_spec_mesh_serves_and_stops_everything(tmp_path):
    spec = MeshSpec.pd(prefills=1, decodes=1, router_flags=("--local-prefill-max-tokens", "0"), stop_grace=30)
    with Launcher(spec, log_dir=tmp_path) as mesh:
        procs = list(mesh.procs)
        assert [p.role for p in procs] == ["prefill", "decode", "router"]
        for w in (*mesh.prefills, *mesh.decodes):
            mesh.wait_serving(w)
        r = httpx.post(mesh.router.http_url + "/v1/completions",
                       json={"model": "pdmesh-tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        mesh.assert_invariants()
        ports = [port for p in procs for port in (p.http_port, p.grpc_port) if port]
    assert mesh.procs == []
    assert all(p.popen.poll() is not None for p in procs)
    # SIGTERM first (stop_grace): the services exit on their own, not by SIGKILL
    assert all(p.popen.returncode != -signal.SIGKILL for p in procs), [p.popen.returncode for p in procs]
    wait_for(lambda: all(port_free(p) for p in ports), 10, "every port of the mesh free again")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["decode-2.log", "prefill-1.log", "router-3.log"]


def test_fake_workers_behind_a_router(tmp_path):
    with Launcher(log_dir=tmp_path) as mesh:
        fakes, prefill, decode = mesh.start_fake_workers()
        router = mesh.start_router([prefill], [decode], "--local-prefill-max-tokens", "0")
        r = httpx.post(router.http_url + "/v1/completions",
                       json={"model": "pdmesh-tiny", "prompt": [1, 2, 3], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        procs = list(mesh.procs)
        assert [p.role for p in procs] == ["fakes", "router"]
    assert all(p.popen.poll() is not None for p in procs)


def test_failed_start_stops_what_had_started(tmp_path):
    spec = MeshSpec((Service("prefill"), Service("decode", ("--no-such-flag",)), Service("router")))
    launcher = Launcher(spec, log_dir=tmp_path)
    started = []
    spawn = launcher.spawn
    launcher.spawn = lambda *a, **kw: started.append(spawn(*a, **kw)) or started[-1]
    with pytest.raises(AssertionError, match="decode exited with 2"):
        launcher.start()
    assert [p.role for p in started] == ["prefill", "decode"]  # the router never started
    assert all(p.popen.poll() is not None for p in started)
    assert launcher.procs == []


def test_make_run_services_die_with_a_killed_launcher(tmp_path):
    ports = {name: free_port() for name in ("PREFILL_GRPC", "PREFILL_HTTP", "DECODE_GRPC", "DECODE_HTTP", "ROUTER")}
    env = {"CUDA_VISIBLE_DEVICES": "", **{f"PDMESH_{name}_PORT": str(port) for name, port in ports.items()}}
    launcher = spawn(service_command("mesh", []), tmp_path / "mesh.log", env)
    try:
        router = f"http://127.0.0.1:{ports['ROUTER']}"

        def ready():
            assert launcher.poll() is None, (tmp_path / "mesh.log").read_text(errors="replace")[-3000:]
            return http_healthy(router)

        wait_for(ready, 180, "make run's router healthy", poll=0.2)
        launcher.kill()
        launcher.wait(timeout=10)
        wait_for(lambda: all(port_free(p) for p in ports.values()), 30,
                 "every service of the killed launcher gone and its ports free")
    finally:
        if launcher.poll() is None:
            launcher.kill()
