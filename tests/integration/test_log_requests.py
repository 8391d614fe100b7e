"""--log-requests off on every service, as a vLLM command line says it (--disable-log-requests):
real prefill, decode and router processes (builtin-random model, real gRPC and NIXL) serve a
completion and a stream with none of the routine per-request lines in their logs, while their
start-up lines are there and the metrics count the requests."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.mesh import mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

QUIET = ("--model", "builtin-random", "--disable-log-requests")
ROUTINE = {"prefill": ("prefill request", "prefill done"), "decode": ("decode request", "decode done"),
           "router": ("request done", "attempt")}


def test_no_routine_line_per_request_on_any_service(tmp_path):
    with mesh_with_router(tmp_path, 1, 1, QUIET, QUIET, QUIET) as (m, (p,), (d,), r):
        body = {"model": "pdmesh-tiny", "prompt": "quiet, please", "max_tokens": 6, "ignore_eos": True}
        done = httpx.post(r.http_url + "/v1/completions", json=body, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 6
        with httpx.stream("POST", r.http_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"
        m.assert_invariants()
        for proc, role in ((p, "prefill"), (d, "decode"), (r, "router")):
            log = proc.log()
            assert not [e for e in ROUTINE[role] if f'"event": "{e}"' in log], (role, log[-3000:])
        assert '"event": "prefill worker ready"' in p.log() and '"event": "worker pool probed"' in r.log()
        assert d.metrics()["pdmesh:generation_tokens_total"] == 12
        assert r.metrics()['pdmesh:router_requests_total'] == 2
