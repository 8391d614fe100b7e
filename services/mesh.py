"""`make run`: the whole mesh on one machine — prefill, decode and router — on the built-in model.

Starts the three services as child processes with the PDMESH_* settings of the environment
(the Makefile loads deploy/pdmesh.env when present), waits until each is healthy, prints a
ready-to-paste curl, and stops everything on Ctrl-C or when any service exits. The services die
with the launcher even when it is SIGKILLed (services/common/parent_death.py), so nothing is left
holding the mesh's ports.

The children write to this terminal, with `--log-format auto`: human-readable lines when that
is a terminal, JSON lines when the output goes to a file or a pipe (pdmesh.env's
PDMESH_LOG_FORMAT=json is meant for compose and Kubernetes; a flag wins over its env twin).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from services.common.parent_death import arm_in_child

PREFILL_GRPC = int(os.environ.get("PDMESH_PREFILL_GRPC_PORT", 50051))
PREFILL_HTTP = int(os.environ.get("PDMESH_PREFILL_HTTP_PORT", 8081))
DECODE_GRPC = int(os.environ.get("PDMESH_DECODE_GRPC_PORT", 50052))
DECODE_HTTP = int(os.environ.get("PDMESH_DECODE_HTTP_PORT", 8082))
ROUTER_PORT = int(os.environ.get("PDMESH_ROUTER_PORT", 8000))
HOST = "127.0.0.1"


def _start(role: str, args: list[str]) -> subprocess.Popen:
    args = [*args, "--log-format", "auto"]
    print(f"[mesh] starting {role}: python -m services.{role} {' '.join(args)}", flush=True)
    # dies with this launcher even if it is SIGKILLed: nothing is left holding the mesh's ports
    return subprocess.Popen([sys.executable, "-m", f"services.{role}", *args], preexec_fn=arm_in_child(os.getpid()))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait(procs: dict[str, subprocess.Popen], urls: dict[str, str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    pending = dict(urls)
    while pending:
        for role in list(pending):
            if procs[role].poll() is not None:
                raise SystemExit(f"[mesh] {role} exited with code {procs[role].returncode} during start-up")
            if _healthy(pending[role]):
                print(f"[mesh] {role} is healthy ({pending.pop(role)})", flush=True)
        if time.monotonic() > deadline:
            raise SystemExit(f"[mesh] timed out waiting for {sorted(pending)}")
        time.sleep(0.2)


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


def main() -> None:
    p_dev, d_dev = _devices()
    print(f"[mesh] devices: prefill {p_dev}, decode {d_dev}", flush=True)
    procs = {
        "prefill": _start(
            "prefill",
            ["--host", HOST, "--grpc-port", str(PREFILL_GRPC), "--http-port", str(PREFILL_HTTP), "--device", p_dev],
        ),
        "decode": _start(
            "decode",
            ["--host", HOST, "--grpc-port", str(DECODE_GRPC), "--http-port", str(DECODE_HTTP), "--device", d_dev],
        ),
    }
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        _wait(procs, {"prefill": f"http://{HOST}:{PREFILL_HTTP}/health", "decode": f"http://{HOST}:{DECODE_HTTP}/health"})
        procs["router"] = _start(
            "router",
            ["--host", HOST, "--port", str(ROUTER_PORT),
             "--prefill", f"{HOST}:{PREFILL_GRPC}", "--decode", f"{HOST}:{DECODE_GRPC}"],
        )
        _wait(procs, {"router": f"http://{HOST}:{ROUTER_PORT}/health"})
        print(
            f"\n[mesh] ready: router http://{HOST}:{ROUTER_PORT}  prefill metrics http://{HOST}:{PREFILL_HTTP}/metrics  "
            f"decode metrics http://{HOST}:{DECODE_HTTP}/metrics\n\n"
            f"curl http://{HOST}:{ROUTER_PORT}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            "  -d '{\"model\": \"pdmesh-tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
            "\"max_tokens\": 32}'\n\n[mesh] Ctrl-C stops everything.",
            flush=True,
        )
        while not stopping and all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        for role, p in procs.items():
            if p.poll() is not None and not stopping:
                print(f"[mesh] {role} exited with code {p.returncode}; stopping the mesh", flush=True)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
