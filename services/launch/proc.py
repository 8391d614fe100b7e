"""One pdmesh process the launcher started: spawn it with its output in a log file (or on this
terminal), reach its HTTP port through its placement, pause, stop and kill it within a bound.

Every child runs in a session of its own, so a Ctrl-C meant for the launcher is not delivered
to it twice; with `parent_death` it is also SIGKILLed by the kernel when the launcher dies
(services/common/parent_death.py), which is only safe from a launcher with no threads.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from services.common.parent_death import arm_in_child
from services.launch.probes import scrape_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]


def service_command(role: str, args: list[str], module: str = "", python: str = "") -> list[str]:
    return [python or sys.executable, "-m", module or f"services.{role}", *args]


def run_service(role: str, args: list[str], timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m services.<role> args` from the repository root, run to its exit with its output
    captured: a command line the service must refuse, --help, a port it cannot bind."""
    return subprocess.run(service_command(role, args), cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def serves_https(role: str, args: list[str], env: dict[str, str]) -> bool:
    """Whether a service started with these flags and this environment serves HTTPS: a router
    given a certificate (--ssl-certfile, or its PDMESH_SSL_CERTFILE twin when the flag is absent)."""
    if role != "router":
        return False
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--ssl-certfile":
            return bool(value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return bool(env.get("PDMESH_SSL_CERTFILE"))


def spawn(cmd: list[str], log_path: pathlib.Path | None, env: dict[str, str] | None = None,
          parent_death: bool = False, cwd: pathlib.Path | None = None,
          unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """`cmd` from `cwd` (default the repository root) with os.environ under `env`, less the
    variables in `unset`; output to `log_path`, or to this terminal when it is None."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for name in unset:
        full_env.pop(name, None)
    out = log_path.open("wb") if log_path is not None else None
    try:
        return subprocess.Popen(
            cmd, cwd=cwd or ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True, preexec_fn=arm_in_child(os.getpid()) if parent_death else None,
        )
    finally:
        if out is not None:
            out.close()  # the child holds its own copy


@dataclass
class Proc:
    role: str  # prefill | decode | router | fakes (services/fakes/workers.py)
    popen: subprocess.Popen
    log_path: pathlib.Path | None
    http_port: int
    grpc_port: int | None = None
    args: list[str] = field(default_factory=list)
    host: str = ""  # its Topology host, "" on this machine
    addr: str = "127.0.0.1"  # where its ports are reached
    env: dict = field(default_factory=dict)  # its own, on top of the launcher's (a restart keeps it)
    # runs a client call where the process can be reached (an observer's namespace for a host)
    call: Callable = field(default=lambda fn, *a, **kw: fn(*a, **kw), repr=False)
    keep_queue: bool = True  # metrics(): `queue`-labelled samples under their own key
    module: str = ""  # what it runs when not services.<role> (a restart runs it again)
    # how it was started, kept for a restart: the source tree it runs from (None: this one),
    # words before the command (e.g. `taskset -c 0`), another interpreter ("": this one)
    cwd: pathlib.Path | None = None
    prefix: tuple[str, ...] = ()
    python: str = ""
    # a router serving HTTPS itself (--ssl-certfile): probed over HTTPS, its certificate not
    # checked (the launcher asks the process it started, whatever name the certificate holds)
    tls: bool = False

    @property
    def grpc_addr(self) -> str:
        return f"{self.addr}:{self.grpc_port}" if self.grpc_port else ""

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.addr}:{self.http_port}"

    @property
    def name(self) -> str:
        return f"{self.role}@{self.host}" if self.host else self.role

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 5) -> httpx.Response:
        return self.call(httpx.get, self.http_url + path, timeout=timeout, verify=not self.tls)

    def post(self, path: str, json: dict, timeout: float = 60, headers: dict | None = None) -> httpx.Response:
        return self.call(httpx.post, self.http_url + path, json=json, timeout=timeout, headers=headers,
                         verify=not self.tls)

    def metrics(self) -> dict[str, float]:
        return self.call(scrape_metrics, self.http_url, self.keep_queue, verify=not self.tls)

    def health(self) -> dict:
        return self.get("/health").json()

    def stop(self) -> None:
        """Pause (SIGSTOP): the process keeps its ports and answers nothing."""
        os.kill(self.popen.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM, then SIGCONT: a stopped process runs again with its SIGTERM already pending."""
        try:
            self.popen.terminate()
            os.kill(self.popen.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def kill(self, grace: float = 0.0) -> None:
        """SIGTERM and up to `grace` seconds to exit (with grace > 0), then SIGKILL; returns once
        it has exited (at most grace + 10 s). A stopped process (SIGSTOP) is resumed only to
        handle the SIGTERM; a kill without grace ends it where it stands: resumed before the
        SIGKILL, it would run for a moment first, and a frozen decode could finish the very
        stream it was killed to cut off."""
        if self.alive():
            if grace > 0:
                self.terminate()
                try:
                    self.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            if self.alive():
                self.popen.kill()
        self.popen.wait(timeout=10)


def stop_all(procs: list[Proc], grace: float = 0.0) -> None:
    """Every process stopped, all of them signalled before any is waited on (one grace for all)."""
    live = [p for p in procs if p.alive()]
    if grace > 0:
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - best effort, keep stopping the others
            pass
