"""Placement in containers: the mesh as a compose project. `Compose.start()` finds an engine,
builds the image, brings the project up and waits until its services are healthy;
`Compose.stop()` takes down what it started (and force-removes anything the engine left). In
between it looks at the containers: their state, published ports, pause, a crashed service.

The command is the README's bring-up line (parsed from README.md, so the two cannot drift) with
the engine's compose command in front, the CPU override and the caller's override files added
after its `-f` files, and only the three pdmesh services named (no image of Prometheus or
Grafana can be pulled on the test machines; the host's Prometheus scrapes instead).

Engines, first found wins (or PDMESH_COMPOSE="docker compose" / "podman-compose"):
  - docker with Compose v2 >= 2.24.4 (it reads the CPU override's `!reset`);
  - podman with podman-compose >= 1.6 (reads `!reset`; on podman 4.3 it cannot wait for
    `condition: service_healthy`, so this module waits for health itself and, without
    systemd, runs the containers' health checks itself: `podman healthcheck run`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx

from services.launch.probes import wait_for
from services.launch.proc import ROOT

DEPLOY = ROOT / "deploy"
CPU_OVERRIDE = pathlib.Path("deploy/docker-compose.cpu.yml")
SERVICES = ("router", "prefill", "decode")
WORKER_HTTP = {"prefill": 8081, "decode": 8082}
PROJECT = os.environ.get("PDMESH_COMPOSE_PROJECT", "pdmesh-compose-test")
PROJECT_LABEL = "com.docker.compose.project"


# Run inside a container: SIGKILL the pdmesh service process (python -m services.<role>; not
# tini, pid 1, whose command line names it too).
KILL_SERVICE = """
import os, pathlib, signal
for pid in sorted(int(d.name) for d in pathlib.Path("/proc").iterdir() if d.name.isdigit()):
    argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
    is_python = os.path.basename(argv[0]).startswith(b"python")
    if is_python and b"-m" in argv and any(a.startswith(b"services.") for a in argv):
        os.kill(pid, signal.SIGKILL)
        print(pid)
        break
else:
    raise SystemExit("no pdmesh service process in this container")
"""


class NoEngine(Exception):
    """No usable container engine + compose; the message says what is missing."""


def _run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _version(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else (0,)


def find_engine() -> tuple[str, list[str]]:
    """(engine CLI, compose command), or NoEngine saying why not."""
    wanted = os.environ.get("PDMESH_COMPOSE", "").split()
    venv_bin = ROOT / ".venv" / "bin"
    if not wanted or wanted[0] == "docker":
        if shutil.which("docker") and _run(["docker", "info"], timeout=20).returncode == 0:
            v = _run(["docker", "compose", "version", "--short"], timeout=20)
            if v.returncode == 0 and _version(v.stdout) >= (2, 24, 4):
                return "docker", ["docker", "compose"]
            if wanted:
                raise NoEngine(f"docker compose v2 >= 2.24.4 needed (for `!reset`), got: {v.stdout or v.stderr}")
        elif wanted:
            raise NoEngine("PDMESH_COMPOSE=docker but `docker info` fails (no Docker engine)")
    if shutil.which("podman"):
        pc = shutil.which("podman-compose") or (
            str(venv_bin / "podman-compose") if (venv_bin / "podman-compose").exists() else None
        )
        if pc is None:
            raise NoEngine("podman is here but podman-compose is not (`make compose-test` installs it)")
        v = _run([pc, "version"], timeout=30)
        if _version(v.stdout) < (1, 6, 0):
            raise NoEngine(f"podman-compose >= 1.6 needed (for `!reset`), got: {v.stdout.strip()}")
        if _run(["podman", "info"], timeout=60).returncode != 0:
            raise NoEngine("`podman info` fails (run ../shared/containers/setup.sh)")
        return "podman", [pc]
    raise NoEngine(
        "no container engine: docker (engine + Compose >= 2.24.4) or podman + podman-compose >= 1.6 "
        "(on the build machines: ../shared/containers/setup.sh)"
    )


def readme_up_args() -> list[str]:
    """The README's bring-up line, without its leading `docker compose`."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.strip().startswith("docker compose ") and " up" in line:
            return shlex.split(line.strip())[2:]
    raise AssertionError("README.md has no `docker compose ... up` line")


def compose_args(overrides: tuple[pathlib.Path, ...] = ()) -> tuple[list[str], list[str]]:
    """(global options, `up` options) of the README's line, with the CPU override and then
    `overrides` (paths from the repository root) added after its `-f` files."""
    words = readme_up_args()
    up = words.index("up")
    globals_, up_opts = words[:up], words[up + 1 :]
    last_f = max(i for i, w in enumerate(globals_) if w == "-f")
    globals_[last_f + 2 : last_f + 2] = [w for f in (CPU_OVERRIDE, *overrides) for w in ("-f", str(f))]
    return ["-p", PROJECT, *globals_], up_opts


def prepare_wheelhouse() -> str:
    """Offline wheels when the CPU torch index cannot be reached (these machines): the host's pip
    resolves the torch pin to its CPU build, and the image installs from deploy/wheelhouse.
    Elsewhere the image uses the index (and any wheels already in deploy/wheelhouse)."""
    try:
        httpx.head("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
        return "index reachable: image installs from the package index"
    except httpx.HTTPError:
        pass
    out = _run([str(ROOT / "scripts" / "wheelhouse.sh")], timeout=900, cwd=ROOT)
    assert out.returncode == 0, f"scripts/wheelhouse.sh failed:\n{out.stdout}\n{out.stderr}"
    wheels = [p.name for p in (DEPLOY / "wheelhouse").glob("torch-*.whl")]
    assert wheels and "+cpu" in wheels[0], (
        f"the wheelhouse's torch is not a CPU build ({wheels}); the CPU torch index is unreachable "
        "and the host's pip resolves the pin to another build"
    )
    return out.stdout.strip()


@dataclass
class Compose:
    engine: str
    compose: list[str]
    env: dict[str, str]
    log_dir: pathlib.Path
    overrides: tuple[pathlib.Path, ...] = ()  # compose files after the CPU override (e.g. a test's settings)
    timings: dict[str, float] = field(default_factory=dict)
    _pump_stop: threading.Event = field(default_factory=threading.Event)
    _pump: threading.Thread | None = None

    @classmethod
    def found(cls, env: dict[str, str], log_dir: pathlib.Path, overrides: tuple[pathlib.Path, ...] = ()) -> Compose:
        """On the first engine find_engine() finds (NoEngine when there is none)."""
        engine, compose = find_engine()
        return cls(engine, compose, env, log_dir, tuple(overrides))

    # --- the whole project ----------------------------------------------------------------------
    def start(self, healthy_within: float) -> Compose:
        """Down whatever a killed earlier run left of the project, build, up, and wait until
        every service is healthy; on failure, print the containers' logs and stop."""
        self.down()
        try:
            self.build()
            self.up()
            t = time.monotonic()
            self.wait_healthy(healthy_within)
            self.timings["healthy_after_up_s"] = time.monotonic() - t
        except BaseException:
            print(self.logs())
            self.stop()
            raise
        return self

    def stop(self) -> dict[str, list[str]]:
        """Down (containers, network, volumes); what the engine still lists of the project
        afterwards is force-removed. Returns what had to be force-removed."""
        self.down()
        left = self.leftovers()
        if left:
            self.force_remove(left)
        return left

    # --- compose ------------------------------------------------------------------------------
    def compose_cmd(self, *args: str) -> list[str]:
        globals_, _ = compose_args(self.overrides)
        return [*self.compose, *globals_, *args]

    def run_compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        cmd = self.compose_cmd(*args)
        out = _run(cmd, timeout=timeout, cwd=ROOT, env=self.env)
        with (self.log_dir / "compose.log").open("a") as f:
            f.write(f"$ {shlex.join(cmd)}\n{out.stdout}\n{out.stderr}\n")
        if check:
            assert out.returncode == 0, f"{shlex.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    def build(self) -> None:
        """One build first (the three services share one image, and parallel cold builds on two
        cores would triple the work); `up --build` then finds every layer cached."""
        t = time.monotonic()
        self.run_compose("build", "prefill", timeout=1800)
        self.timings["build_s"] = time.monotonic() - t

    def up(self) -> None:
        _, up_opts = compose_args(self.overrides)
        t = time.monotonic()
        # the one-shot token service first by name: an engine that cannot wait on
        # service_completed_successfully still creates it (the workers restart until its file exists)
        self.run_compose("up", *up_opts, "internal-token", *SERVICES, timeout=900)
        self.timings["up_s"] = time.monotonic() - t
        if self.engine == "podman":
            self._start_health_pump()

    def down(self) -> subprocess.CompletedProcess:
        self._pump_stop.set()
        if self._pump:
            self._pump.join(timeout=30)
        return self.run_compose("down", "-v", "--remove-orphans", "-t", "10", timeout=180, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project that still exist."""
        flt = ["--filter", f"label={PROJECT_LABEL}={PROJECT}"]
        found = {
            "containers": _run([self.engine, "ps", "-a", "-q", *flt]).stdout.split(),
            "networks": _run([self.engine, "network", "ls", "-q", *flt]).stdout.split(),
            "volumes": _run([self.engine, "volume", "ls", "-q", *flt]).stdout.split(),
        }
        # podman-compose names its network <project>_default; be sure it is gone too
        nets = _run([self.engine, "network", "ls", "--format", "{{.Name}}"]).stdout.split()
        found["networks"] += [n for n in nets if n.startswith(PROJECT + "_") and n not in found["networks"]]
        return {k: v for k, v in found.items() if v}

    def force_remove(self, left: dict[str, list[str]]) -> None:
        for cid in left.get("containers", []):
            _run([self.engine, "rm", "-f", "-v", cid], timeout=60)
        for net in left.get("networks", []):
            _run([self.engine, "network", "rm", "-f", net], timeout=60)
        for vol in left.get("volumes", []):
            _run([self.engine, "volume", "rm", "-f", vol], timeout=60)

    # --- containers ---------------------------------------------------------------------------
    def container(self, service: str) -> str:
        out = _run(
            [
                self.engine, "ps", "-a", "-q", "--no-trunc",
                "--filter", f"label={PROJECT_LABEL}={PROJECT}",
                "--filter", f"label=com.docker.compose.service={service}",
            ]
        ).stdout.split()
        assert len(out) == 1, f"expected one {service} container, found {out}"
        return out[0]

    def inspect(self, service: str) -> dict:
        out = _run([self.engine, "inspect", self.container(service)])
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)[0]

    def state(self, service: str) -> dict:
        return self.inspect(service)["State"]

    def health_status(self, service: str) -> str:
        st = self.state(service)
        return (st.get("Health") or st.get("Healthcheck") or {}).get("Status", "")

    def published(self, service: str, port: int) -> str:
        """host:port where the container's `port` is published."""
        out = _run([self.engine, "port", self.container(service), str(port)])
        assert out.returncode == 0 and out.stdout.strip(), f"{service}:{port} is not published: {out.stderr}"
        host, _, hport = out.stdout.strip().splitlines()[0].rpartition(":")
        host = "127.0.0.1" if host in ("0.0.0.0", "", "[::]") else host
        return f"{host}:{hport}"

    def url(self, service: str) -> str:
        port = 8000 if service == "router" else WORKER_HTTP[service]
        return "http://" + self.published(service, port)

    def pause(self, service: str) -> None:
        out = _run([self.engine, "pause", self.container(service)])
        assert out.returncode == 0, out.stderr

    def unpause(self, service: str) -> None:
        out = _run([self.engine, "unpause", self.container(service)])
        assert out.returncode == 0, out.stderr

    def kill_service_process(self, service: str) -> None:
        """The worker process inside the container dies (SIGKILL), as in a crash: tini exits
        with it and the engine applies the restart policy. (`docker kill` would count as a
        deliberate stop, which `restart: unless-stopped` respects.)"""
        out = _run([self.engine, "exec", self.container(service), "python", "-c", KILL_SERVICE], timeout=30)
        # (the container may die before `exec` returns: its exit code then varies by engine)
        assert out.stdout.strip().isdigit(), f"could not kill {service}'s process: {out.stdout}{out.stderr}"

    def logs(self) -> str:
        parts = []
        for s in SERVICES:
            try:
                out = _run([self.engine, "logs", "--tail", "60", self.container(s)], timeout=30)
                parts.append(f"--- {s} ---\n{out.stdout[-6000:]}{out.stderr[-3000:]}")
            except Exception as e:  # noqa: BLE001 - diagnostics only
                parts.append(f"--- {s}: {e!r}")
        return "\n".join(parts)

    # --- health ---------------------------------------------------------------------------------
    def _start_health_pump(self) -> None:
        """podman 4.3 runs HEALTHCHECKs from systemd timers; without systemd they never run
        (what ../shared/containers/healthcheck-pump does, bounded by this stack's life)."""

        def pump():
            while not self._pump_stop.wait(2.0):
                for s in SERVICES:
                    try:
                        _run([self.engine, "healthcheck", "run", self.container(s)], timeout=15)
                    except Exception:  # noqa: BLE001 - paused, restarting or gone: try again later
                        pass

        self._pump_stop.clear()
        self._pump = threading.Thread(target=pump, name="health-pump", daemon=True)
        self._pump.start()

    def wait_healthy(self, timeout: float, services=SERVICES) -> None:
        def all_healthy():
            status = {s: self.health_status(s) for s in services}
            for s in services:
                st = self.state(s)
                assert st.get("Status") != "exited" or st.get("Restarting"), f"{s} exited:\n{self.logs()}"
            return all(v == "healthy" for v in status.values()) and status

        wait_for(all_healthy, timeout, f"{', '.join(services)} to be healthy", poll=0.5)
