"""`make run` reads deploy/pdmesh.env (or ENV_FILE) for what the environment does not set: a
variable given in the shell or on make's command line wins over the file. The recipe runs as written, with PY replaced by a script that prints
what the mesh would have been started with."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from services.launch.proc import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def run_env(tmp_path, env: dict[str, str], *make_args: str) -> dict[str, str]:
    fake = tmp_path / "py"
    fake.write_text('#!/bin/sh\nfor k in PDMESH_MODEL PDMESH_POLICY PDMESH_ROUTER_PORT; do\n'
                    '  eval "echo $k=\\${$k-unset}"\ndone\necho "ARGS=$*"\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDMESH_", "MAKE"))}
    out = subprocess.run(["make", "-s", "-o", "venv", "-o", "proto", "run", f"PY={fake}", *make_args],
                         cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_the_env_file_fills_in_what_the_environment_does_not_set(tmp_path):
    seen = run_env(tmp_path, {})
    assert seen["PDMESH_MODEL"] == "builtin" and seen["PDMESH_POLICY"] == "cache_aware"
    assert seen["PDMESH_ROUTER_PORT"] == "unset" and seen["ARGS"] == "-m services.mesh"


def test_the_shell_and_make_s_command_line_win_over_the_env_file(tmp_path):
    model = str(tmp_path / "a model's folder")  # a space and a quote survive the round
    seen = run_env(tmp_path, {"PDMESH_MODEL": model}, "PDMESH_POLICY=round_robin", "PDMESH_ROUTER_PORT=9000")
    assert seen["PDMESH_MODEL"] == model and seen["PDMESH_POLICY"] == "round_robin"
    assert seen["PDMESH_ROUTER_PORT"] == "9000"


def test_another_env_file(tmp_path):
    env_file = tmp_path / "mine.env"
    env_file.write_text("PDMESH_POLICY=least_loaded\nPDMESH_MODEL=/models/x\n")
    seen = run_env(tmp_path, {"PDMESH_MODEL": "/models/y"}, f"ENV_FILE={env_file}")
    assert seen["PDMESH_POLICY"] == "least_loaded" and seen["PDMESH_MODEL"] == "/models/y"
