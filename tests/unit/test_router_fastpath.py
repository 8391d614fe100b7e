"""The generation routes served as plain ASGI (services/router/fastpath.py) answer as FastAPI did:
what the fast path does not take (other methods, a trailing slash) is FastAPI's, and an
exception escaping the handler is the same 500 body, counted."""

from __future__ import annotations

import httpx
import pytest

from services.router import generation_routes
from tests.unit.test_router_app import Cluster, completion, post

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def test_an_unhandled_error_is_the_internal_error_body(cluster, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(generation_routes, "parse_spec", broken)
    r = post(cluster, "/v1/completions", completion())
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error.", "type": "server_error", "param": None,
                                  "code": "internal_error"}}
    assert cluster.metric("pdmesh:router_requests_total", status="500") == 1
    assert cluster.router.active == 0


def test_what_the_fast_path_leaves_is_fastapis(cluster):
    r = httpx.get(cluster.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(cluster.url + "/v1/completions/", json=completion(), timeout=10, follow_redirects=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello"  # FastAPI's redirect, then served
    paths = httpx.get(cluster.url + "/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions"} <= set(paths)
