"""The command line the launcher gives a worker: the spec's --device unless the worker's own flags
name one, so the printed command says each flag once."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from services import mesh
from services.launch.launcher import Launcher
from services.launch.spec import MeshSpec


def worker_args(launcher: Launcher, *flags: str) -> list[str]:
    seen = []
    launcher.spawn = lambda role, args, *rest: seen.append(args)  # no process: only its command line
    launcher.start_worker("prefill", *flags, wait=False, grpc_port=50000, http_port=50001)
    return seen[0]


def test_the_spec_device_is_given_when_the_worker_names_none():
    args = worker_args(Launcher(MeshSpec((), device="cuda:3")))
    assert args.count("--device") == 1 and args[args.index("--device") + 1] == "cuda:3"


def test_a_worker_s_own_device_is_the_only_one_on_its_command_line():
    args = worker_args(Launcher(MeshSpec(())), "--device", "cuda:1")
    assert args.count("--device") == 1 and args[args.index("--device") + 1] == "cuda:1"


def test_make_run_s_mesh_names_each_worker_s_device_once():
    for service in mesh.spec("cuda:0", "cuda:1").services:
        if service.role != "router":
            args = worker_args(Launcher(mesh.spec("cuda:0", "cuda:1")), *service.flags)
            assert args.count("--device") == 1


def test_make_run_s_mesh_answers_help_and_refuses_unknown_flags_without_starting():
    # the mesh has no flags (its settings are PDMESH_*): --help says so, a flag it does not know
    # stops it before any service starts (nothing listens, nothing to clean up)
    def run(*args):
        return subprocess.run([sys.executable, "-m", "services.mesh", *args], capture_output=True, text=True,
                              timeout=60, cwd=pathlib.Path(__file__).resolve().parents[2])

    helped = run("--help")
    assert helped.returncode == 0 and "PDMESH_ROUTER_PORT" in helped.stdout and "[mesh]" not in helped.stdout
    refused = run("--port", "9000")
    assert refused.returncode == 2 and "unrecognized arguments" in refused.stderr
    assert "[mesh]" not in refused.stdout
