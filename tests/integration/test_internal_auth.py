"""Internal authentication fails closed, with real processes:

- a worker asked to listen on 0.0.0.0 without an internal token refuses to start (exit 78, a log
  line saying why) unless --allow-insecure-bind says so;
- a router whose token the workers refuse ejects them, logs the mismatch, and its /health is 503
  with the reason; a router with the right token serves the same workers.
"""

from __future__ import annotations

import httpx
import pytest

from services.common.bind_guard import EXIT_CONFIG
from tests.integration.http_client import post_json
from tests.integration.mesh import Mesh, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TOKEN = "right-token-0123456789abcdef"


def test_a_worker_on_a_wildcard_address_without_a_token_refuses_to_start(mesh: Mesh):
    # all four side by side: each start is mostly imports, and they do not depend on each other
    refused = [mesh.start_worker(role, "--host", "0.0.0.0", wait=False) for role in ("prefill", "decode")]
    allowed = mesh.start_decode("--host", "0.0.0.0", "--allow-insecure-bind", "true", wait=False)
    with_token = mesh.start_prefill("--host", "0.0.0.0", env={"PDMESH_INTERNAL_TOKEN": TOKEN}, wait=False)
    for proc in refused:
        assert proc.popen.wait(timeout=60) == EXIT_CONFIG
        assert "refusing to listen on '0.0.0.0' without an internal token" in proc.log()
    mesh.wait_all_healthy([allowed, with_token])
    assert allowed.alive() and "WITHOUT an internal token" in allowed.log()
    assert with_token.alive()


def test_a_token_mismatch_ejects_the_workers_and_health_says_why(mesh: Mesh):
    env = {"PDMESH_INTERNAL_TOKEN": TOKEN}
    p = mesh.start_prefill(env=env, wait=False)
    d = mesh.start_decode(env=env, wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    wrong = mesh.start_router([p], [d], env={"PDMESH_INTERNAL_TOKEN": "wrong-token"}, wait=False)
    none = mesh.start_router([p], [d], env={"PDMESH_INTERNAL_TOKEN": ""}, wait=False)
    for r in (wrong, none):
        def refused(r=r):
            resp = httpx.get(r.http_url + "/health", timeout=2)
            return resp if resp.status_code == 503 and "internal token mismatch" in resp.json().get("reason", "") else None

        resp = wait_for(refused, 60, "router /health 503 naming the token mismatch")
        body = resp.json()
        assert body["status"] == "unavailable"
        assert "UNAUTHENTICATED" in body["prefill"][p.grpc_addr]["last_error"]
        assert "UNAUTHENTICATED" in body["decode"][d.grpc_addr]["last_error"]
        assert "internal token mismatch" in r.log()
        reply = httpx.post(r.http_url + "/v1/completions", json={"model": "pdmesh-tiny", "prompt": "Hi",
                                                                  "max_tokens": 4}, timeout=30)
        assert reply.status_code == 503, reply.text
    right = mesh.start_router([p], [d], env=env)
    out = post_json(right.http_url, "/v1/completions", {"model": "pdmesh-tiny", "prompt": "Hi", "max_tokens": 4,
                                                                "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 4
    wait_for(lambda: right.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "router holds no request")
    mesh.assert_invariants()
