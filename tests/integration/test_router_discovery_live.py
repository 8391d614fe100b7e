"""Workers named by host name: the router resolves the name, serves through the resolved
address, and tells decode that address (so decode attaches to the prefill holding the room)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_router_resolves_worker_names(mesh):
    (p,), (d,) = mesh.start_workers(1, 1)
    router = mesh.start_router([f"localhost:{p.grpc_port}"], [f"localhost:{d.grpc_port}"])
    health = httpx.get(router.http_url + "/health", timeout=5).json()
    assert list(health["prefill"]) == [p.grpc_addr] and list(health["decode"]) == [d.grpc_addr]
    r = httpx.post(
        router.http_url + "/v1/completions",
        json={"model": "pdmesh-tiny", "prompt": "hello", "max_tokens": 5, "ignore_eos": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert f'"prefill": "{p.grpc_addr}"' in d.log()  # decode attached to the resolved address
    mesh.assert_invariants()


def test_router_refuses_a_malformed_worker_address(mesh):
    p = mesh.start_prefill()
    with pytest.raises(AssertionError, match="exited with 2"):
        mesh.start_router(["not-an-address"], [p])
