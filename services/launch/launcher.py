"""The one way pdmesh processes are started: prefills, decodes and routers as processes on this
machine (local.py) or on the hosts of a network-namespace topology (hosts.py), each waited on
until healthy and all stopped by `stop()`.

From a spec (spec.py), all at once; workers load side by side, the router starts once they are
healthy, and a failure stops whatever had started:

    with Launcher(MeshSpec.pd(prefills=2, decodes=2), log_dir=tmp) as mesh:
        httpx.post(mesh.router.http_url + "/v1/completions", json=...)

Or step by step, as the tests and benches that kill, pause and restart processes do:

    launcher = Launcher(log_dir=tmp)
    p, d = launcher.start_prefill(), launcher.start_decode()
    router = launcher.start_router([p], [d], "--policy", "round_robin")
    launcher.restart(d, drop_flags=("--faults",))
    launcher.stop()

Each process writes to a log file of its own under `log_dir` (a restarted one gets a new one),
or to this terminal when log_dir is None. A SIGTERM to the launching process raises
KeyboardInterrupt, as Ctrl-C does, so the `with` or `finally` around a launcher stops its
processes then too (terminate.py).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

import httpx

from services.launch.local import Local
from services.launch.probes import QUEUE_GAUGES, grpc_serving, wait_for
from services.launch.proc import Proc, serves_https, service_command, spawn, stop_all
from services.launch.spec import WORKER_ROLES, MeshSpec
from services.launch.terminate import interrupt_on_sigterm


class Launcher:
    def __init__(self, spec: MeshSpec | None = None, log_dir: pathlib.Path | str | None = None,
                 placement=None, say: Callable[[str], None] | None = None):
        self.spec = spec or MeshSpec(())
        self.log_dir = pathlib.Path(log_dir) if log_dir is not None else None
        self.placement = placement or Local()
        self.say = say or (lambda msg: None)  # progress lines (make run prints them)
        self.procs: list[Proc] = []  # every live process this launcher started, in order
        self._spawned = 0
        interrupt_on_sigterm()  # a SIGTERM then stops what this launcher started (terminate.py)

    # -- a whole mesh from the spec

    def start(self) -> Launcher:
        try:
            for s in self.spec.services:
                if s.role in WORKER_ROLES:
                    self.start_worker(s.role, *s.flags, host=s.host, env=s.env, wait=False,
                                      grpc_port=s.grpc_port, http_port=s.http_port)
            prefills, decodes = self.prefills, self.decodes
            self.wait_all_healthy([*prefills, *decodes])
            for s in self.spec.of_role("router"):
                self.start_router(prefills, decodes, *s.flags, host=s.host, port=s.http_port, env=s.env)
        except BaseException:
            self.stop()
            raise
        return self

    def of_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    @property
    def prefills(self) -> list[Proc]:
        return self.of_role("prefill")

    @property
    def decodes(self) -> list[Proc]:
        return self.of_role("decode")

    @property
    def router(self) -> Proc:
        return self.of_role("router")[0]

    def stop(self) -> None:
        """Every process this launcher started, stopped (spec.stop_grace to exit on SIGTERM,
        then SIGKILL) and waited for."""
        stop_all(self.procs, self.spec.stop_grace)
        self.procs.clear()
        self.placement.close()

    close = stop

    def __enter__(self) -> Launcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- one process at a time

    def spawn(self, role: str, args: list[str], http_port: int, grpc_port: int | None,
              env: dict | None = None, host: str = "", module: str = "", cwd: pathlib.Path | None = None,
              prefix: tuple[str, ...] = (), python: str = "") -> Proc:
        """`python -m services.<role> args` (or `module`) where the placement puts `host`; no wait.
        A bench may run it from another source tree (`cwd`), behind `prefix` (e.g. `taskset -c
        0`), or with another interpreter (`python`, e.g. a bench-only venv's)."""
        self._spawned += 1
        log_path = (self.log_dir / self.placement.log_name(role, host, self._spawned)) if self.log_dir else None
        cmd = [*prefix, *self.placement.command(host, service_command(role, args, module, python))]
        env_over = {**self.placement.env, **self.spec.env, **(env or {})}
        popen = spawn(cmd, log_path, env_over, self.spec.parent_death, cwd=cwd)
        proc = Proc(role, popen, log_path, http_port, grpc_port, list(args), host, self.placement.addr(host),
                    dict(env or {}), self.placement.call, self.placement.keep_queue, module, cwd, tuple(prefix),
                    python, tls=serves_https(role, args, {**os.environ, **env_over}))
        self.procs.append(proc)
        self.say(f"starting {proc.name}: python -m {module or 'services.' + role} {' '.join(args)}")
        return proc

    def _model_args(self) -> list[str]:
        return ["--model", self.spec.model] if self.spec.model else []

    def start_worker(self, role: str, *extra: str, host: str = "", env: dict | None = None, wait: bool = True,
                     grpc_port: int = 0, http_port: int = 0, prefix: tuple[str, ...] = ()) -> Proc:
        grpc, http = self.placement.ports(role, host, grpc_port, http_port)
        # the spec's device unless the worker's own flags name one (the command line then says it once)
        device = [] if "--device" in extra else ["--device", self.spec.device]
        args = [*self.placement.service_args(role, host), "--grpc-port", str(grpc), "--http-port", str(http),
                *device, *self._model_args(), *extra]
        proc = self.spawn(role, args, http, grpc, env, host, prefix=prefix)
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_prefill(self, *extra: str, **kw) -> Proc:
        return self.start_worker("prefill", *extra, **kw)

    def start_decode(self, *extra: str, **kw) -> Proc:
        return self.start_worker("decode", *extra, **kw)

    def start_workers(self, prefills: int, decodes: int, prefill_flags: tuple[str, ...] = (),
                      decode_flags: tuple[str, ...] = ()) -> tuple[list[Proc], list[Proc]]:
        """Start the workers side by side (models load in parallel), then wait for all of them."""
        ps = [self.start_prefill(*prefill_flags, wait=False) for _ in range(prefills)]
        ds = [self.start_decode(*decode_flags, wait=False) for _ in range(decodes)]
        self.wait_all_healthy([*ps, *ds])
        return ps, ds

    def start_router(self, prefills: list[Proc | str], decodes: list[Proc | str], *extra: str, host: str = "",
                     port: int = 0, env: dict | None = None, wait: bool = True, module: str = "",
                     cwd: pathlib.Path | None = None, prefix: tuple[str, ...] = ()) -> Proc:
        """Workers as processes (their gRPC address) or as address specs (e.g. a host name);
        `wait`: until its /health is 200. `module`, `cwd`, `prefix`: as spawn's (a bench's
        router of another source tree, or a stand-in speaking the router's command line)."""
        _, http = self.placement.ports("router", host, 0, port)
        args = [*self.placement.service_args("router", host), "--port", str(http)]
        for p in prefills:
            args += ["--prefill", p if isinstance(p, str) else p.grpc_addr]
        for d in decodes:
            args += ["--decode", d if isinstance(d, str) else d.grpc_addr]
        proc = self.spawn("router", [*args, *self._model_args(), *extra], http, None, env, host, module, cwd, prefix)
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_fake_workers(self, host: str = "", wait: bool = True) -> tuple[Proc, str, str]:
        """Instant fake prefill and decode in one process (services/fakes/workers.py, gRPC only):
        the process and the two addresses to give a router."""
        prefill_port, _ = self.placement.ports("prefill", host)
        decode_port, _ = self.placement.ports("decode", host)
        proc = self.spawn("fakes", ["--prefill-port", str(prefill_port), "--decode-port", str(decode_port)], 0,
                          prefill_port, None, host, module="services.fakes.workers")
        addr = self.placement.addr(host)
        decode_addr = f"{addr}:{decode_port}"
        if wait:
            self.wait_serving(proc)
            self.wait_serving(proc, addr=decode_addr)
        return proc, proc.grpc_addr, decode_addr

    def restart(self, proc: Proc, wait: bool = True, drop_flags: tuple[str, ...] = (),
                add_args: tuple[str, ...] = ()) -> Proc:
        """Kill `proc` and start the same role on the same host and ports (a new epoch), with
        the same flags and environment except `drop_flags` (each removed with its value, e.g.
        "--faults"), plus `add_args`."""
        proc.kill()
        at = self.procs.index(proc)
        self.procs.remove(proc)
        args = list(proc.args)
        for flag in drop_flags:
            while flag in args:
                i = args.index(flag)
                del args[i : i + 2]
        new = self.spawn(proc.role, [*args, *add_args], proc.http_port, proc.grpc_port, proc.env, proc.host,
                         proc.module, proc.cwd, proc.prefix, proc.python)
        self.procs.remove(new)
        self.procs.insert(at, new)  # the order holds: prefills[0] is still the first prefill
        if wait:
            self.wait_healthy(new)
        return new

    # -- probes

    def wait_healthy(self, proc: Proc, timeout: float | None = None) -> None:
        """Until proc's /health answers 200; fails at once, with the end of its log, if it exits."""
        timeout = timeout or self.spec.health_timeout or self.placement.health_timeout

        def ok():
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
            return proc.get("/health", timeout=2).status_code == 200

        wait_for(ok, timeout, f"{proc.name} on {proc.addr}:{proc.http_port} to become healthy",
                 poll=self.placement.poll)
        self.say(f"{proc.name} is healthy ({proc.http_url}/health)")

    def wait_all_healthy(self, procs: list[Proc], timeout: float | None = None) -> None:
        """Until every one of `procs` answers /health 200, probed together, so one that exits
        fails the wait at once instead of after the others have loaded."""
        timeout = timeout or self.spec.health_timeout or self.placement.health_timeout
        pending = list(procs)

        def all_ok():
            for proc in list(pending):
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
                try:
                    healthy = proc.get("/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    pending.remove(proc)
                    self.say(f"{proc.name} is healthy ({proc.http_url}/health)")
            return not pending

        try:
            wait_for(all_ok, timeout, "the workers to become healthy", poll=self.placement.poll)
        except AssertionError as e:
            if pending and str(e).startswith("timed out"):
                still = ", ".join(f"{p.name} on {p.addr}:{p.http_port}" for p in pending)
                raise AssertionError(f"{e}; still not healthy: {still}") from None
            raise

    def wait_serving(self, proc: Proc, timeout: float | None = None, addr: str = "") -> None:
        """Until a worker's gRPC health service (at `addr`, default its gRPC address) reports
        SERVING: what the router itself probes."""
        timeout = timeout or self.spec.health_timeout or self.placement.health_timeout
        addr = addr or proc.grpc_addr

        def ok():
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()[-3000:]}")
            return self.placement.call(grpc_serving, addr)

        wait_for(ok, timeout, f"{proc.name} at {addr} to serve gRPC", poll=self.placement.poll)

    def assert_invariants(self, timeout: float = 10, procs: list[Proc] | None = None, nixl: bool = False) -> None:
        """All queue gauges 0 and every KV pool whole, on every live worker (of `procs`, default
        all); with `nixl`, also no NIXL transfer handle and no room left."""
        for proc in procs or self.procs:
            if proc.role not in QUEUE_GAUGES or not proc.alive():
                continue

            def settled(proc=proc):
                m, h = proc.metrics(), proc.health()
                nonzero = {g: m.get(g) for g in QUEUE_GAUGES[proc.role] if m.get(g, 0) != 0}
                whole = not nonzero and h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]
                return whole and (not nixl or (h["nixl_live_handles"] == 0 and h["rooms"] == 0))

            what = "queue gauges 0 and KV pool whole" + (", no NIXL handle" if nixl else "")
            wait_for(settled, timeout, f"{proc.name} {proc.grpc_addr}: {what}", poll=self.placement.poll)
