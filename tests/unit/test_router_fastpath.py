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


def test_head_of_a_get_route_is_its_get_without_the_body(cluster):
    for path in ("/health", "/v1/models", "/v1/models/pdmesh-tiny", "/metrics", "/version", "/load", "/ping"):
        got = httpx.get(cluster.url + path, timeout=10)
        head = httpx.head(cluster.url + path, timeout=10)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"" and head.headers.get("content-type") == got.headers.get("content-type"), path
        if path not in ("/metrics", "/health", "/load"):  # their bodies change between two calls
            assert head.headers["content-length"] == got.headers["content-length"], path
    # a path without a GET route: the method the client sent is the one named
    r = httpx.head(cluster.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.content == b""
    assert r.headers["content-type"] == "application/json"
    r = httpx.request("HEAD", cluster.url + "/nowhere", timeout=10)
    assert r.status_code == 404
    # and the connection stays usable after a HEAD (no body left behind on it)
    with httpx.Client(base_url=cluster.url, timeout=10) as client:
        for _ in range(3):
            assert client.head("/health").status_code == 200
            assert client.post("/v1/completions", json=completion()).json()["choices"][0]["text"] == "Hello"
