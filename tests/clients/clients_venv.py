"""The real clients' own virtual environment (.venv-clients, built by scripts/clients_test.sh from
requirements-clients.txt) and how the tests run its commands: as subprocesses, bounded in time,
with a scratch HF_HOME so nothing is read from or written to the user's caches."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess

import pytest

from tests.integration.mesh import ROOT

CLIENTS_VENV = ROOT / ".venv-clients"
CLIENTS_BIN = CLIENTS_VENV / "bin"


def require_clients_venv() -> None:
    """Skip (with the way to build it) where the clients venv is absent: plain `pytest tests/clients`
    on a machine that never ran `make clients-test`."""
    if not (CLIENTS_BIN / "python").exists():
        pytest.skip("no .venv-clients: `make clients-test` (or scripts/clients_test.sh) builds it")


def run_client(argv: list[str], tmp: pathlib.Path, *, timeout: float, cwd: pathlib.Path = ROOT,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a clients-venv command to completion (killed with its process group after `timeout`);
    fail with its output's tail when it exits non-zero."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    full_env.update({"HF_HOME": str(tmp / "hf-home"), "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", **(env or {})})
    proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{argv[0]} ran past {timeout}s") from None
    finally:
        # AIPerf runs its services as child processes: whatever is left of the session goes too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{out[-4000:]}\n{err[-4000:]}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
