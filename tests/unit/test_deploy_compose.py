"""deploy/: the env file, docker-compose.yml (+ the CPU override), the Dockerfile and the health
check script.

docker-compose v1 (Debian's `docker-compose` package) validates compose files offline; the
tests that need it skip, naming the package, when it is missing (scripts/ensure_test_tools.sh
installs it). Every flag and PDMESH_* variable the files pass is checked against the services'
real `--help`.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest
import yaml

from services.common import config
from services.launch.ports import free_port
from services.launch.proc import run_service

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENV_FILE = DEPLOY / "pdmesh.env"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_CPU = DEPLOY / "docker-compose.cpu.yml"
COMPOSE_1P2D = DEPLOY / "docker-compose.1p2d.yml"
DOCKERFILE = DEPLOY / "Dockerfile"

ROLES = ("prefill", "decode", "router")
ROLE_FLAGS = {"prefill": config.PREFILL_FLAGS, "decode": config.DECODE_FLAGS, "router": config.ROUTER_FLAGS}
PDMESH_SERVICES = ("router", "prefill", "decode")
TOKEN_FILE = "/run/pdmesh/internal-token"
GPU_SLICES = {"prefill": ["0"], "decode": ["1"]}


# --- shared helpers (the k8s, Prometheus and Grafana deploy tests import these) ---------------


def need_tool(binary: str, apt_package: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(
            f"needs `{binary}` from the Debian package `{apt_package}` "
            f"(apt-get install {apt_package}, or run scripts/ensure_test_tools.sh as root)"
        )
    return path


@functools.cache
def service_cli(role: str) -> tuple[frozenset[str], frozenset[str]]:
    """(flags, PDMESH_* env twins) of `python -m services.<role>`, read from its real --help."""
    main = ROOT / "services" / role / "__main__.py"
    if not main.exists():  # not written yet: the lists --help is built from
        flags = ROLE_FLAGS[role]
        return frozenset(f.name for f in flags), frozenset(f.env for f in flags)
    proc = run_service(role, ["--help"], timeout=120, env={"COLUMNS": "250"})
    assert proc.returncode == 0, f"python -m services.{role} --help failed:\n{proc.stderr[-3000:]}"
    flags = frozenset(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", proc.stdout)) - {"help"}
    envs = frozenset(re.findall(r"\bPDMESH_[A-Z0-9_]+", proc.stdout))
    assert flags and envs, f"no flags found in the --help of services.{role}:\n{proc.stdout}"
    return flags, envs


def all_env_twins() -> set[str]:
    return set().union(*(service_cli(r)[1] for r in ROLES))


def role_of(argv: list[str]) -> str | None:
    """'prefill' for ['python', '-m', 'services.prefill', ...]; None if not a pdmesh service."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1].startswith("services."):
            return argv[i + 1].split(".", 1)[1]
    return None


def check_service_argv(argv: list[str], where: str) -> str:
    """Every flag in argv exists in the role's --help, and the values parse with its types."""
    role = role_of(argv)
    assert role in ROLES, f"{where}: not `python -m services.<role>`: {argv}"
    start = argv.index(f"services.{role}") + 1
    flags = service_cli(role)[0]
    given = [a[2:].split("=", 1)[0] for a in argv[start:] if a.startswith("--")]
    unknown = sorted(set(given) - flags)
    assert not unknown, f"{where}: services.{role} has no flag(s) {unknown}; its flags: {sorted(flags)}"
    # values must parse with the flag's type and choices (argparse exits on a bad one)
    parser = config.build_parser(f"services.{role}", "", ROLE_FLAGS[role])
    try:
        parser.parse_args(argv[start:])
    except SystemExit as e:
        raise AssertionError(f"{where}: services.{role} rejects {argv[start:]}") from e
    return role


def check_env_value(name: str, value: str, where: str) -> None:
    """A PDMESH_* value parses with the type (and choices) of every flag it is the twin of."""
    for role in ROLES:
        for flag in ROLE_FLAGS[role]:
            if flag.env != name:
                continue
            if flag.repeatable or value == "":
                continue
            try:
                parsed = flag.type(value)
            except ValueError as e:
                raise AssertionError(f"{where}: {name}={value!r} is not a valid {flag.type.__name__}") from e
            if flag.choices:
                assert parsed in flag.choices, f"{where}: {name}={value!r} not one of {flag.choices}"


def read_env_file(path: pathlib.Path = ENV_FILE) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=([^\s'\"$`\\#]*)", line)
        assert m, f"{path.name}:{n}: not KEY=value without quotes/spaces/$: {line!r}"
        assert m.group(1) not in out, f"{path.name}:{n}: {m.group(1)} given twice"
        out[m.group(1)] = m.group(2)
    return out


def compose_config(*files: pathlib.Path, env_file: pathlib.Path | None = ENV_FILE, project_dir=None) -> dict:
    exe = need_tool("docker-compose", "docker-compose")
    cmd = [exe]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    if project_dir is not None:
        cmd += ["--project-directory", str(project_dir)]
    for f in files:
        cmd += ["-f", str(f)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEPLOY_", "PDMESH_", "COMPOSE_"))}
    proc = subprocess.run([*cmd, "config"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


class _Reset:
    """Marks a value tagged `!reset` (Docker Compose >= 2.24.4): drop what the base file set."""


class _ResetLoader(yaml.SafeLoader):
    pass


_ResetLoader.add_constructor("!reset", lambda loader, node: _Reset())


def apply_resets(base: dict, override: dict) -> tuple[dict, dict]:
    """Do what compose v2 does with `!reset`, so compose v1 can validate the effective files:
    the tagged key is removed from the override and from the base."""

    def walk(b, o):
        for key in list(o):
            if isinstance(o[key], _Reset):
                del o[key]
                if isinstance(b, dict):
                    b.pop(key, None)
            elif isinstance(o[key], dict) and isinstance(b, dict) and isinstance(b.get(key), dict):
                walk(b[key], o[key])
            elif isinstance(o[key], dict):
                walk(None, o[key])

    walk(base, override)
    return base, override


def cpu_config(tmp_path: pathlib.Path) -> dict:
    """The merged base + CPU override, validated by docker-compose."""
    base = yaml.safe_load(COMPOSE.read_text())
    override = yaml.load(COMPOSE_CPU.read_text(), Loader=_ResetLoader)  # noqa: S506 - SafeLoader subclass
    base, override = apply_resets(base, override)
    (tmp_path / "base.yml").write_text(yaml.safe_dump(base, sort_keys=False))
    (tmp_path / "cpu.yml").write_text(yaml.safe_dump(override, sort_keys=False))
    # relative paths (build context, env_file, volumes) stay relative to deploy/
    return compose_config(tmp_path / "base.yml", tmp_path / "cpu.yml", project_dir=DEPLOY)


@pytest.fixture(scope="module")
def base_cfg() -> dict:
    return compose_config(COMPOSE)


# --- the env file -----------------------------------------------------------------------------


def test_env_file_is_valid_for_sh_and_compose_and_names_only_real_flags():
    env = read_env_file()
    twins = all_env_twins()
    pdmesh = {k: v for k, v in env.items() if k.startswith("PDMESH_")}
    unknown = sorted(set(pdmesh) - twins)
    assert not unknown, f"pdmesh.env sets {unknown}, which no service has as a flag twin"
    for k, v in pdmesh.items():
        check_env_value(k, v, "pdmesh.env")
    # topology, not behaviour: set by compose / k8s / make run per process, never shared
    for k in (
        "PDMESH_HOST",
        "PDMESH_GRPC_PORT",
        "PDMESH_HTTP_PORT",
        "PDMESH_PORT",
        "PDMESH_PREFILL",
        "PDMESH_DECODE",
        "PDMESH_DEVICE",
        "PDMESH_WORKER_ID",
        "PDMESH_FAULTS",
    ):
        assert k not in env, f"pdmesh.env must not set {k}: it differs per process"
    other = sorted(k for k in env if not k.startswith(("PDMESH_", "DEPLOY_")))
    assert not other, f"pdmesh.env: keys must be PDMESH_* (flag twins) or DEPLOY_* (compose): {other}"
    # `make run` sources it with `set -a`: sh must read exactly the same values
    out = subprocess.run(
        ["sh", "-c", f'set -a; . "{ENV_FILE}"; env -0'], capture_output=True, timeout=10, env={}, check=True
    ).stdout.decode()
    sourced = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    assert {k: sourced.get(k) for k in env} == env


# The deployments' deliberate departures from a flag's default, and why. Any other value in
# pdmesh.env equals the default, so what the README and --help promise is what compose, k8s and
# `make run` run (a stale copy of an old default once kept cache-aware routing off everywhere).
DEPLOYED_NOT_DEFAULT = {
    "PDMESH_LOG_FORMAT": "json",  # collected by a log pipeline, never a terminal
    "PDMESH_CANARY_INTERVAL": "30",  # a serving mesh probes its pairs; a bare process does not
}


def test_env_file_values_are_the_flag_defaults_unless_declared():
    env = {k: v for k, v in read_env_file().items() if k.startswith("PDMESH_")}
    for k, v in env.items():
        if k in DEPLOYED_NOT_DEFAULT:
            assert v == DEPLOYED_NOT_DEFAULT[k], f"pdmesh.env {k}={v!r}, declared {DEPLOYED_NOT_DEFAULT[k]!r}"
            continue
        if v == "":  # the file's rule: empty is the flag's default
            continue
        for role in ROLES:
            for flag in ROLE_FLAGS[role]:
                if flag.env == k:
                    parse = config._bool if flag.type is bool else flag.type  # bool("false") is True
                    assert parse(v) == flag.default, (
                        f"pdmesh.env {k}={v!r} but {role}'s --{flag.name} defaults to {flag.default!r}: "
                        "use the default, or declare the departure in DEPLOYED_NOT_DEFAULT"
                    )


# --- docker-compose.yml -------------------------------------------------------------------------


def test_compose_file_is_accepted_and_has_the_six_services(base_cfg):
    assert set(base_cfg["services"]) == {"internal-token", "router", "prefill", "decode", "prometheus", "grafana"}


def test_every_pdmesh_service_gets_the_generated_internal_token(base_cfg):
    services = base_cfg["services"]
    init = services["internal-token"]
    assert init["command"] == ["python", "-m", "services.common.token_file", TOKEN_FILE]
    assert init["restart"] == "no"
    for name in PDMESH_SERVICES:
        svc = services[name]
        assert svc["environment"]["PDMESH_INTERNAL_TOKEN_FILE"] == TOKEN_FILE, name
        if name == "router":
            assert svc["depends_on"]["internal-token"] == {"condition": "service_completed_successfully"}, name
        else:  # podman would not restart a worker whose one-shot dependency has exited: they wait for the file
            assert "internal-token" not in svc.get("depends_on", {}), name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}{':ro' if v.get('read_only') else ''}"
                  for v in svc["volumes"]]
        assert any(m.startswith("internal-token:/run/pdmesh") and m.endswith(":ro") for m in mounts), (name, mounts)
    assert "internal-token" in base_cfg["volumes"]


def test_compose_defaults_equal_the_env_file():
    """${DEPLOY_*:-default} in the compose file == DEPLOY_* in pdmesh.env: forgetting
    --env-file changes nothing."""
    assert compose_config(COMPOSE, env_file=None) == compose_config(COMPOSE)
    text = COMPOSE.read_text()
    used = set(re.findall(r"\$\{(DEPLOY_[A-Z0-9_]+):-", text))
    declared = {k for k in read_env_file() if k.startswith("DEPLOY_")}
    assert used == declared, f"compose uses {sorted(used)}, pdmesh.env declares {sorted(declared)}"
    assert not re.search(r"\$\{(?!DEPLOY_)", text), (
        "compose interpolates a variable pdmesh.env does not declare"
    )


def test_each_worker_has_its_own_gpu_slice(base_cfg):
    seen = {}
    for name, svc in base_cfg["services"].items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if name not in GPU_SLICES:
            assert not devices, f"{name} must not reserve a GPU"
            continue
        assert len(devices) == 1, f"{name}: one device request expected, got {devices}"
        dev = devices[0]
        assert dev.get("driver") == "nvidia" and "gpu" in dev.get("capabilities", []), dev
        assert "count" not in dev, f"{name}: a slice is named by device_ids, not count"
        assert dev["device_ids"] == GPU_SLICES[name], f"{name}: device_ids {dev['device_ids']}"
        seen[name] = set(dev["device_ids"])
    assert not (seen["prefill"] & seen["decode"]), "prefill and decode share a GPU"
    # inside its container each worker sees only its slice, as cuda:0
    for name in GPU_SLICES:
        assert base_cfg["services"][name]["environment"]["PDMESH_DEVICE"] == "cuda:0"


def test_health_checks_and_startup_order(base_cfg):
    services = base_cfg["services"]
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test") and not hc.get("disable"), f"{name} has no health check"
    for name in PDMESH_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "/app/deploy/healthcheck.py"], f"{name}: {test}"
    for name in GPU_SLICES:  # model loading: failures during start_period do not count
        assert services[name]["healthcheck"]["start_period"] in ("10m", "600s", "10m0s")
    deps = services["router"]["depends_on"]
    assert deps == {
        "internal-token": {"condition": "service_completed_successfully"},
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert "depends_on" not in services["prometheus"], (
        "Prometheus must run (and alert) while workers are down"
    )


def test_ucx_settings_between_containers(base_cfg):
    for name in GPU_SLICES:
        svc = base_cfg["services"][name]
        env = svc["environment"]
        assert env["UCX_TLS"] == "tcp,cuda_copy", f"{name}: UCX must be pinned to TCP between containers"
        # agent names embed the hostname: a fixed hostname/container_name would make scaled
        # replicas collide (and container_name forbids --scale)
        assert "hostname" not in svc and "container_name" not in svc, name
        assert svc.get("shm_size") and svc["ulimits"]["memlock"] == -1
        assert not svc.get("ports"), f"{name}: worker ports are internal (publishing them blocks --scale)"


def test_every_flag_and_env_the_compose_files_pass_exists(base_cfg, tmp_path):
    raw = yaml.safe_load(COMPOSE.read_text())
    raw_cpu = yaml.load(COMPOSE_CPU.read_text(), Loader=_ResetLoader)  # noqa: S506
    for cfg_name, cfg in (("docker-compose.yml", base_cfg), ("docker-compose.cpu.yml", cpu_config(tmp_path))):
        for name in PDMESH_SERVICES:
            svc = cfg["services"][name]
            role = check_service_argv(svc["command"], f"{cfg_name} {name}")
            assert role == name, f"{cfg_name}: service {name} runs services.{role}"
            twins = service_cli(role)[1]
            for key, value in svc.get("environment", {}).items():
                if key.startswith("PDMESH_"):
                    assert key in all_env_twins(), f"{cfg_name} {name}: {key} is no service's flag twin"
                    check_env_value(key, str(value), f"{cfg_name} {name}")
            # set explicitly for this service (not from the shared env file): must be its own flag
            for raw_file in (raw, raw_cpu):
                own = raw_file["services"].get(name, {}).get("environment", {}) or {}
                for key in own:
                    if key.startswith("PDMESH_"):
                        assert key in twins, f"{name}: {key} is not a flag twin of services.{role}"
            # the env file reaches the service, and compose resolved it to the same values
            env_file = read_env_file()
            for key, value in env_file.items():
                if key.startswith("PDMESH_"):
                    assert str(svc["environment"].get(key)) == value, f"{name}: {key}"


def test_ports_and_addresses_agree(base_cfg):
    s = base_cfg["services"]
    cmd = {n: s[n]["command"] for n in PDMESH_SERVICES}

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert (
        flag(cmd["prefill"], "--host")
        == flag(cmd["decode"], "--host")
        == flag(cmd["router"], "--host")
        == "0.0.0.0"
    )
    assert flag(cmd["router"], "--prefill") == f"prefill:{flag(cmd['prefill'], '--grpc-port')}"
    assert flag(cmd["router"], "--decode") == f"decode:{flag(cmd['decode'], '--grpc-port')}"
    for n in ("prefill", "decode"):
        exposed = {str(p) for p in s[n].get("expose", [])}
        assert {flag(cmd[n], "--grpc-port"), flag(cmd[n], "--http-port")} <= exposed, n
    published = {(str(p["target"]), str(p["published"])) for p in s["router"]["ports"]}
    assert (flag(cmd["router"], "--port"), "8000") in published
    assert {str(p["target"]) for p in s["prometheus"]["ports"]} == {"9090"}
    assert {str(p["target"]) for p in s["grafana"]["ports"]} == {"3000"}


def _seconds(duration: str) -> float:
    """A compose duration as `docker compose config` writes it: 1m10s, 40s, 1.5s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def test_stops_drain_within_the_stop_grace_period():
    """docker stop waits stop_grace_period before SIGKILL: the router's --shutdown-timeout and a
    worker's --drain-timeout, with the supervisor's margin, fit inside it, in both compose files."""
    from services.router.processes import STOP_MARGIN

    env = read_env_file()
    for name, svc in compose_config(COMPOSE, COMPOSE_1P2D)["services"].items():
        argv = svc.get("command") or []
        role = role_of(argv)
        if role not in ROLES:
            continue
        flag = "shutdown-timeout" if role == "router" else "drain-timeout"
        (f,) = [f for f in ROLE_FLAGS[role] if f.name == flag]
        if f"--{flag}" in argv:
            timeout = float(argv[argv.index(f"--{flag}") + 1])
        else:
            timeout = float((svc.get("environment") or {}).get(f.env) or env.get(f.env) or f.default)
        assert timeout + STOP_MARGIN <= _seconds(svc["stop_grace_period"]), (name, timeout, svc["stop_grace_period"])


def test_cpu_override_removes_the_gpus_and_switches_to_the_cpu_build(tmp_path):
    cfg = cpu_config(tmp_path)
    assert set(cfg["services"]) == {"internal-token", "router", "prefill", "decode", "prometheus", "grafana"}
    assert cfg["services"]["internal-token"]["image"] == "pdmesh:cpu"
    for name in PDMESH_SERVICES:
        svc = cfg["services"][name]
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        assert not devices, f"CPU override leaves a GPU reservation on {name}: {devices}"
        assert svc["build"]["args"]["BASE_IMAGE"].startswith("debian:")
        assert svc["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert svc["image"] == "pdmesh:cpu"
    for name in GPU_SLICES:
        env = cfg["services"][name]["environment"]
        assert env["PDMESH_DEVICE"] == "cpu" and env["UCX_TLS"] == "tcp"
        assert cfg["services"][name]["healthcheck"]["test"][1:3] == ["python", "/app/deploy/healthcheck.py"]
    assert cfg["services"]["router"]["depends_on"]["prefill"] == {"condition": "service_healthy"}


def _gpus(svc: dict) -> list[str]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [i for d in devices for i in d.get("device_ids", [])]


def test_scaling_example_gives_every_worker_its_own_gpu_and_the_router_every_worker():
    cfg = compose_config(COMPOSE, COMPOSE_1P2D)["services"]
    workers = {n: s for n, s in cfg.items() if role_of(s.get("command", [])) in ("prefill", "decode")}
    assert set(workers) == {"prefill", "decode", "decode-2"}
    gpus = [g for s in workers.values() for g in _gpus(s)]
    assert sorted(gpus) == ["0", "1", "2"] and all(len(_gpus(s)) == 1 for s in workers.values())
    # decode-2 is `decode` apart from its GPU and its network aliases (no drift)
    strip = ("deploy", "networks")
    assert {k: v for k, v in cfg["decode-2"].items() if k not in strip} == {
        k: v for k, v in cfg["decode"].items() if k not in strip
    }
    # the router names each worker by a unique alias, on its gRPC port, and waits for all
    argv = cfg["router"]["command"]
    check_service_argv(argv, "docker-compose.1p2d.yml router")
    addrs = {
        role: [argv[i + 1] for i, a in enumerate(argv) if a == f"--{role}"] for role in ("prefill", "decode")
    }
    assert addrs == {"prefill": ["prefill:50051"], "decode": ["decode-1:50052", "decode-2:50052"]}
    aliases = {
        n: set(s.get("networks", {}).get("default", {}).get("aliases", [])) | {n} for n, s in workers.items()
    }
    for listed in addrs.values():
        for addr in listed:
            host = addr.split(":")[0]
            owners = [n for n, a in aliases.items() if host in a]
            assert len(owners) == 1, f"router address {addr} is ambiguous: {owners}"
    # Prometheus' DNS discovery of "decode" finds both decode workers
    assert sorted(n for n, a in aliases.items() if "decode" in a) == ["decode", "decode-2"]
    assert set(cfg["router"]["depends_on"]) == {*workers, "internal-token"}


# --- Dockerfile -------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_one_image_cuda_or_cpu_same_pins_non_root_healthcheck():
    raw = yaml.safe_load(COMPOSE.read_text())  # (no docker-compose needed for this one)
    ins = _dockerfile_instructions()
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1] if "=" in rest else None for w, rest in ins if w == "ARG"
    }
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:"), "the default base image is CUDA"
    assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    assert ins[0][0] == "ARG" and ("FROM", "${BASE_IMAGE}") in ins
    # every build arg compose passes is declared
    cpu = yaml.load(COMPOSE_CPU.read_text(), Loader=_ResetLoader)  # noqa: S506
    for name in PDMESH_SERVICES:
        for compose_file in (raw, cpu):
            build = compose_file["services"][name]["build"]
            assert set(build["args"]) <= set(args)
            assert build["dockerfile"] == "deploy/Dockerfile" and build["context"] == ".."
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    # the pinned set of the Makefile: requirements.txt itself, torch first from the wheel index
    assert "pip install -r requirements.txt" in runs
    assert "grep -E '^torch==' requirements.txt" in runs and '--index-url "$TORCH_INDEX_URL"' in runs
    assert re.search(r"^torch==\d", (ROOT / "requirements.txt").read_text(), re.M)
    # offline: wheels in deploy/wheelhouse/ (scripts/wheelhouse.sh) are bind-mounted into that RUN
    # (never a layer) and installed with --no-index; the folder is in git (README), its wheels not
    assert "--mount=type=bind,source=deploy/wheelhouse," in runs
    assert "pip install --no-index --find-links /tmp/wheelhouse -r requirements.txt" in runs
    assert (DEPLOY / "wheelhouse" / "README.md").exists()
    assert "deploy/wheelhouse/*.whl" in (ROOT / ".gitignore").read_text().splitlines()
    assert "!deploy/wheelhouse/" in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert [w for w, _ in ins].count("FROM") == 1, "one stage: every layer stays cacheable (buildah)"
    assert "scripts/gen_proto.py" in runs, "generated gRPC code is built into the image"
    # non-root from USER on, and the user is not root
    users = [rest for w, rest in ins if w == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    last_user = max(i for i, (w, _) in enumerate(ins) if w == "USER")
    assert all(w not in ("RUN", "COPY", "ADD") for w, _ in ins[last_user:])
    hc = [rest for w, rest in ins if w == "HEALTHCHECK"]
    assert len(hc) == 1 and "/app/deploy/healthcheck.py" in hc[0]
    # every path it copies exists and is let through the Dockerfile's .dockerignore
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for w, rest in ins:
        if w == "COPY":
            src = rest.split()[0]
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert any(line.strip() == "!" + src for line in ignore), (
                f"{src} is not allowed by Dockerfile.dockerignore"
            )
    exposed = {p for w, rest in ins if w == "EXPOSE" for p in rest.split()}
    assert {"8000", "8081", "8082", "50051", "50052"} <= exposed


def test_the_files_the_image_copies_are_enough_to_run_every_role(tmp_path):
    """Rebuild the image's /app from exactly what the Dockerfile COPYs, generate the gRPC code
    as the Dockerfile does, and load all three entry points from there (not from the repo)."""
    app = tmp_path / "app"
    for w, rest in _dockerfile_instructions():
        if w != "COPY":
            continue
        src, dst = rest.split()[:2]
        target = app / dst.rstrip("/") if dst not in ("./", ".") else app / pathlib.Path(src).name
        if (ROOT / src).is_dir():
            shutil.copytree(
                ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__", "generated", "*.pyc")
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / src, target)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    gen = subprocess.run(
        [sys.executable, "scripts/gen_proto.py"],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert gen.returncode == 0, gen.stderr
    probe = f"""
import runpy, sys
for role in ("router", "prefill", "decode"):
    sys.argv = ["python -m services." + role, "--help"]
    try:
        runpy.run_module("services." + role, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (role, e.code)
assert sys.modules["services"].__file__.startswith({str(app)!r}), sys.modules["services"].__file__
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=app, capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, f"the image's files do not run:\n{proc.stderr[-3000:]}"
    for role in ("router", "prefill", "decode"):
        assert f"services.{role}" in proc.stdout


# --- deploy/healthcheck.py --------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("pdmesh_healthcheck", DEPLOY / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_healthcheck_finds_role_and_port_from_the_command_line(healthcheck, tmp_path):
    rp = healthcheck.role_and_port
    assert rp(["python", "-m", "services.prefill", "--grpc-port", "50051", "--http-port", "9001"], {}) == (
        "prefill",
        9001,
    )
    assert rp(["python", "-m", "services.decode", "--http-port=9002"], {}) == ("decode", 9002)
    assert rp(["python", "-m", "services.decode"], {"PDMESH_HTTP_PORT": "9003"}) == ("decode", 9003)
    assert rp(["python", "-m", "services.decode"], {}) == ("decode", 8082)
    assert rp(["python", "-m", "services.router", "--port", "8123"], {}) == ("router", 8123)
    assert rp(["/usr/bin/tini", "--", "python", "-m", "services.router"], {}) == ("router", 8000)
    assert rp(["tini", "--"], {}) is None and rp(["python", "-m", "http.server"], {}) is None
    # and from a /proc tree: tini (pid 1) is skipped, the service (pid 7) is found
    for pid, argv, env in (
        (1, ["tini", "--", "python"], ""),
        (7, ["python", "-m", "services.prefill"], "PDMESH_HTTP_PORT=9100"),
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (tmp_path / str(pid) / "environ").write_bytes(env.encode() + b"\0")
    (tmp_path / "self").mkdir()
    assert healthcheck.find_service(tmp_path) == ("prefill", 9100, "http", None)


def test_healthcheck_asks_an_https_router_over_https(healthcheck):
    tls = healthcheck.serves_tls
    assert tls(["python", "-m", "services.router", "--ssl-certfile", "/c.pem"], {})
    assert tls(["python", "-m", "services.router", "--ssl-certfile=/c.pem"], {})
    assert tls(["python", "-m", "services.router"], {"PDMESH_SSL_CERTFILE": "/c.pem"})
    assert not tls(["python", "-m", "services.router"], {"PDMESH_SSL_CERTFILE": ""})
    assert not tls(["python", "-m", "services.router", "--port", "8000"], {})


def test_healthcheck_presents_a_client_certificate_where_one_is_required(healthcheck, tmp_path):
    pair = healthcheck.client_pair
    router = ["python", "-m", "services.router", "--ssl-certfile", "/r.pem", "--ssl-keyfile", "/r.key"]
    assert pair(router, {}, {}) is None  # none asked for
    assert pair([*router, "--ssl-cert-reqs", "2"], {}, {}) == ("/r.pem", "/r.key")  # its own pair
    assert pair(router, {"PDMESH_SSL_CERT_REQS": "2"}, {}) == ("/r.pem", "/r.key")
    assert pair([*router, "--ssl-cert-reqs", "1"], {}, {}) is None  # optional: an unverifiable one would fail
    own = {"PDMESH_HEALTH_CERTFILE": "/h.pem", "PDMESH_HEALTH_KEYFILE": "/h.key"}
    assert pair([*router, "--ssl-cert-reqs", "2"], {}, own) == ("/h.pem", "/h.key")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cmdline").write_bytes(b"\0".join(a.encode() for a in [*router, "--ssl-cert-reqs=2"]) + b"\0")
    (tmp_path / "9" / "environ").write_bytes(b"PDMESH_PORT=8443\0")
    assert healthcheck.find_service(tmp_path, own_env={}) == ("router", 8443, "https", ("/r.pem", "/r.key"))


def _serve(status: int):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status": "ok"}'
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize("status,rc", [(200, 0), (503, 1)])
def test_healthcheck_exit_code_follows_health(status, rc):
    srv = _serve(status)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/health"
        proc = subprocess.run(
            [sys.executable, str(DEPLOY / "healthcheck.py")],
            capture_output=True,
            timeout=20,
            env={**os.environ, "PDMESH_HEALTH_URL": url},
        )
        assert proc.returncode == rc, proc.stderr
    finally:
        srv.shutdown()
        srv.server_close()


def test_healthcheck_fails_fast_when_nothing_listens():
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py")],
        capture_output=True,
        timeout=20,
        env={**os.environ, "PDMESH_HEALTH_URL": f"http://127.0.0.1:{port}/health"},
    )
    assert proc.returncode == 1
