"""Browsers' cross-origin requests (CORS) on the real server (uvicorn with the router's protocol,
gRPC to scripted workers): preflights answered, responses marked for the browser — the generation
routes' fast path, streams and errors included — as vLLM's defaults and flags do."""

from __future__ import annotations

import httpx

from tests.unit.test_router_app import MODEL, chat, cluster, cluster_factory, completion  # noqa: F401 - fixtures

UI = "http://localhost:3000"


def preflight(c, path: str, origin: str = UI, method: str = "POST", headers: str | None = "authorization, content-type",
              **extra) -> httpx.Response:
    h = {"Origin": origin, "Access-Control-Request-Method": method, **extra}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return httpx.options(c.url + path, headers=h, timeout=10)


def test_every_origin_is_allowed_by_default_on_every_kind_of_response(cluster):  # noqa: F811
    r = preflight(cluster, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in r.headers
    origin = {"Origin": UI}
    # the fast path's whole body, a stream, a route through FastAPI, a 400 and a 404: each readable by the page
    r = httpx.post(cluster.url + "/v1/completions", json=completion(), headers=origin, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    assert r.headers["access-control-allow-origin"] == "*"
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=chat(stream=True), headers=origin,
                      timeout=10) as s:
        assert s.headers["access-control-allow-origin"] == "*" and s.headers["content-type"].startswith("text/event-stream")
        assert s.read().decode().endswith("data: [DONE]\n\n")
    r = httpx.get(cluster.url + "/v1/models", headers=origin)
    assert r.headers["access-control-allow-origin"] == "*" and r.json()["data"][0]["id"] == MODEL
    r = httpx.post(cluster.url + "/v1/completions", json=completion(max_tokens=-1), headers=origin)
    assert r.status_code == 400 and r.headers["access-control-allow-origin"] == "*"
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.get(cluster.url + "/nowhere", headers=origin)
    assert r.status_code == 404 and r.headers["access-control-allow-origin"] == "*"
    # clients that are not browsers send no Origin: their responses are as before
    r = httpx.post(cluster.url + "/v1/completions", json=completion(), timeout=10)
    assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
    cluster.all_rpcs_ended()


def test_named_origins_only(cluster_factory):  # noqa: F811
    c = cluster_factory(allowed_origins=[UI, "https://chat.example.com"])
    r = preflight(c, "/v1/completions", origin="https://chat.example.com")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://chat.example.com"
    assert "Origin" in r.headers["vary"]
    r = preflight(c, "/v1/completions", origin="https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    error = r.json()["error"]
    assert error["code"] == "cors_not_allowed" and "origin" in error["message"], error
    ok = httpx.post(c.url + "/v1/completions", json=completion(), headers={"Origin": UI}, timeout=10)
    assert ok.headers["access-control-allow-origin"] == UI and "Origin" in ok.headers["vary"]
    # the browser enforces the rule: the request is served, its response just lacks the header
    other = httpx.post(c.url + "/v1/completions", json=completion(), headers={"Origin": "https://evil.example"},
                       timeout=10)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    c.all_rpcs_ended()


def test_methods_headers_and_credentials(cluster_factory):  # noqa: F811
    c = cluster_factory(allowed_methods=["post", "GET"], allowed_headers=["Content-Type"], allow_credentials=True)
    r = preflight(c, "/v1/completions", headers="content-type")
    # with credentials the origin is named, never *
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert r.headers["access-control-allow-credentials"] == "true"
    r = preflight(c, "/v1/completions", method="DELETE", headers=None)
    assert r.status_code == 400 and "method" in r.json()["error"]["message"]
    r = preflight(c, "/v1/completions", headers="x-secret")
    assert r.status_code == 400 and "headers" in r.json()["error"]["message"]
    r = httpx.post(c.url + "/v1/completions", json=completion(), headers={"Origin": UI}, timeout=10)
    assert r.headers["access-control-allow-origin"] == UI and r.headers["access-control-allow-credentials"] == "true"
    c.all_rpcs_ended()


def test_a_preflight_needs_no_api_key_and_a_refusal_is_readable(cluster_factory):  # noqa: F811
    c = cluster_factory(api_key="k")
    # the browser sends the preflight without the Authorization header it asks about
    assert preflight(c, "/v1/chat/completions").status_code == 200
    r = httpx.post(c.url + "/v1/chat/completions", json=chat(), headers={"Origin": UI}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.post(c.url + "/v1/chat/completions", json=chat(), timeout=10,
                   headers={"Origin": UI, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    c.all_rpcs_ended()


def test_no_origin_allowed(cluster_factory):  # noqa: F811
    c = cluster_factory(allowed_origins=[])
    r = preflight(c, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "cors_not_allowed"
    r = httpx.post(c.url + "/v1/completions", json=completion(), headers={"Origin": UI}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    c.all_rpcs_ended()
