"""schemathesis fuzzes the router's own /openapi.json in front of real workers: no 5xx, ever.

The schema is the router's, as served (FastAPI's, with the request models of
services/router/openapi.py). One bound is applied to the generated bodies
(tests/integration/schemathesis_hooks.py): at most 16 new tokens per request, so the time
budget goes to many different bodies rather than a few 8,000-token generations.

Time budget: 60 s of fuzzing; PDMESH_FUZZ_SECONDS overrides it. The seed is
fixed so that `make test` is repeatable (PDMESH_FUZZ_SEED explores others: `random` draws one).
Afterwards the mesh still serves and every queue is empty.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.integration.mesh import ROOT, Mesh

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(400)]

FUZZ_SECONDS = int(os.environ.get("PDMESH_FUZZ_SECONDS", "60"))
FUZZ_SEED = os.environ.get("PDMESH_FUZZ_SEED", "20261130")


def test_schemathesis_finds_no_server_error(tmp_path):
    m = Mesh(tmp_path)
    try:
        p = m.start_prefill(wait=False)
        d = m.start_decode(wait=False)
        m.wait_healthy(p)
        m.wait_healthy(d)
        r = m.start_router([p], [d], "--request-timeout", "120", "--max-concurrent-requests", "64")
        schema = httpx.get(r.http_url + "/openapi.json", timeout=10).json()
        assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])
        cli = [sys.executable, "-m", "schemathesis.cli", "--no-color", "run", r.http_url + "/openapi.json",
               "--checks", "not_a_server_error", "--max-time", str(FUZZ_SECONDS), "--workers", "1",
               "--request-timeout", "130", "--suppress-health-check", "all"]
        if FUZZ_SEED != "random":
            cli += ["--seed", FUZZ_SEED]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.integration.schemathesis_hooks",
               "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=FUZZ_SECONDS + 240)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        assert "generated" in out and " failed" not in out.split("Test cases:")[-1], out[-3000:]

        # the mesh still serves, and nothing is left behind anywhere
        ok = httpx.post(r.http_url + "/v1/completions", timeout=30,
                        json={"model": "pdmesh-tiny", "prompt": "still there?", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        m.assert_invariants(timeout=30)
        metrics = httpx.get(r.http_url + "/metrics", timeout=5).text
        served = [line for line in metrics.splitlines() if line.startswith("pdmesh:router_requests_total{")]
        assert served and not any('status="5' in line for line in served), served
    finally:
        m.close()
