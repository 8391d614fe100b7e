"""`make run`: the whole mesh on one machine — prefill, decode and router — on the built-in model.

Starts the three services as child processes (services/launch/launcher.py, from the spec below)
with the PDMESH_* settings of the environment
(the Makefile loads deploy/pdmesh.env when present), waits until each is healthy, prints a
ready-to-paste curl, and stops everything on Ctrl-C or when any service exits. The services die
with the launcher even when it is SIGKILLed (services/common/parent_death.py), so nothing is left
holding the mesh's ports.

The children write to this terminal, with `--log-format auto`: human-readable lines when that
is a terminal, JSON lines when the output goes to a file or a pipe (pdmesh.env's
PDMESH_LOG_FORMAT=json is meant for compose and Kubernetes; a flag wins over its env twin).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import time

from services.common.config import SERVICE_LINK
from services.common.listening import port_taken
from services.common.model_name import served_name
from services.launch.launcher import Launcher
from services.launch.local import Local
from services.launch.spec import MeshSpec, Service


def _port(env: str, default: int) -> int:
    """A port from the environment. A Kubernetes service link (a Service named pdmesh-router
    injects PDMESH_ROUTER_PORT=tcp://10.0.0.1:8000) is not a setting: the default stands, as
    for the services' own flags (services/common/config.py)."""
    raw = os.environ.get(env, "").strip()
    if not raw or SERVICE_LINK.fullmatch(raw):
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{env}={raw!r} is not a port number") from None


PREFILL_GRPC = _port("PDMESH_PREFILL_GRPC_PORT", 50051)
PREFILL_HTTP = _port("PDMESH_PREFILL_HTTP_PORT", 8081)
DECODE_GRPC = _port("PDMESH_DECODE_GRPC_PORT", 50052)
DECODE_HTTP = _port("PDMESH_DECODE_HTTP_PORT", 8082)
ROUTER_PORT = _port("PDMESH_ROUTER_PORT", 8000)
HOST = "127.0.0.1"


def _refuse_taken_ports() -> None:
    """Before anything starts: a port already taken (another mesh on this machine, say) ends the
    command with the port and its setting named. Started anyway, the services' health checks
    would be answered by whatever holds the ports, and the mesh would say it is ready when it is
    not."""
    ports = {"PDMESH_PREFILL_GRPC_PORT": PREFILL_GRPC, "PDMESH_PREFILL_HTTP_PORT": PREFILL_HTTP,
             "PDMESH_DECODE_GRPC_PORT": DECODE_GRPC, "PDMESH_DECODE_HTTP_PORT": DECODE_HTTP,
             "PDMESH_ROUTER_PORT": ROUTER_PORT}
    taken = [f"{HOST}:{port} ({env}): {why}" for env, port in ports.items() if (why := port_taken(HOST, port))]
    if taken:
        raise SystemExit("[mesh] cannot start: another process holds the mesh's ports (is a mesh already "
                         "running?). Stop it, or set the PDMESH_*_PORT named to a free port:\n  "
                         + "\n  ".join(taken))


def router_url() -> str:
    """The router's address as clients reach it: HTTPS when PDMESH_SSL_CERTFILE gives it a certificate."""
    return f"{'https' if os.environ.get('PDMESH_SSL_CERTFILE') else 'http'}://{HOST}:{ROUTER_PORT}"


def example_curl() -> str:
    """A request that works against this mesh as configured: its model's served name (not always
    the built-in one), and the API key's header when PDMESH_API_KEY is set."""
    model = served_name(os.environ.get("PDMESH_MODEL", "") or "builtin",
                        os.environ.get("PDMESH_SERVED_MODEL_NAME", ""))
    # the first key where several are set (comma-separated), left to the shell so the secret is not printed
    auth = " -H \"Authorization: Bearer ${PDMESH_API_KEY%%,*}\"" if os.environ.get("PDMESH_API_KEY") else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    return (f"curl {router_url()}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"  -d {shlex.quote(body)}")


def _devices() -> tuple[str, str]:
    """One device slice per worker: GPU 0 and GPU 1 when there are two, else shared/CPU."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        gpus = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        gpus = 0
    if gpus >= 2:
        return "cuda:0", "cuda:1"
    if gpus == 1:
        return "cuda:0", "cuda:0"
    return "cpu", "cpu"


def spec(p_dev: str, d_dev: str) -> MeshSpec:
    auto = ("--log-format", "auto")
    return MeshSpec(
        (Service("prefill", ("--device", p_dev, *auto), grpc_port=PREFILL_GRPC, http_port=PREFILL_HTTP),
         Service("decode", ("--device", d_dev, *auto), grpc_port=DECODE_GRPC, http_port=DECODE_HTTP),
         Service("router", auto, http_port=ROUTER_PORT)),
        # dies with this launcher even if it is SIGKILLed: nothing is left holding the mesh's ports
        parent_death=True,
        stop_grace=10,
        health_timeout=300,
    )


def _arguments() -> None:
    """No flags: the mesh's settings are the environment's PDMESH_* (deploy/pdmesh.env under
    `make run`), as for compose. `--help` says so, and anything else is refused rather than
    ignored while a mesh starts."""
    argparse.ArgumentParser(
        prog="python -m services.mesh",
        description="The whole mesh on this machine (prefill, decode and router), on the built-in "
                    "model unless PDMESH_MODEL names a checkpoint folder, until Ctrl-C. `make run` runs "
                    "it with deploy/pdmesh.env loaded.",
        epilog=f"Settings come from the environment, not flags: ports PDMESH_ROUTER_PORT ({ROUTER_PORT}), "
               f"PDMESH_PREFILL_GRPC_PORT ({PREFILL_GRPC}), PDMESH_PREFILL_HTTP_PORT ({PREFILL_HTTP}), "
               f"PDMESH_DECODE_GRPC_PORT ({DECODE_GRPC}), PDMESH_DECODE_HTTP_PORT ({DECODE_HTTP}), and every "
               "service's PDMESH_* twin of its flags (docs/flags.md).",
    ).parse_args()


def main() -> None:
    _arguments()
    _refuse_taken_ports()
    p_dev, d_dev = _devices()
    print(f"[mesh] devices: prefill {p_dev}, decode {d_dev}", flush=True)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    mesh = Launcher(spec(p_dev, d_dev), log_dir=None, placement=Local(bind=HOST),
                    say=lambda msg: print(f"[mesh] {msg}", flush=True))
    try:
        try:
            mesh.start()
        except AssertionError as e:  # a service exited or stayed unhealthy: the launcher stopped the rest
            raise SystemExit(f"[mesh] {e}") from None
        print(
            f"\n[mesh] ready: router {router_url()}  prefill metrics http://{HOST}:{PREFILL_HTTP}/metrics  "
            f"decode metrics http://{HOST}:{DECODE_HTTP}/metrics\n\n{example_curl()}\n\n[mesh] Ctrl-C stops everything.",
            flush=True,
        )
        while not stopping and all(p.alive() for p in mesh.procs):
            time.sleep(0.5)
        for p in mesh.procs:
            if not p.alive() and not stopping:
                print(f"[mesh] {p.name} exited with code {p.popen.returncode}; stopping the mesh", flush=True)
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
