"""POST /reset_prefix_cache and /flush_cache against scripted workers: workers that cannot reset
make it a 503 naming them (an OpenAI-style error body), and the API key guards it. The reset
itself, on real workers, is tested in tests/integration/test_prefix_cache_mesh.py."""

from __future__ import annotations

import httpx

from tests.unit.test_router_app import cluster, cluster_factory  # noqa: F401 - fixtures


def test_workers_that_cannot_reset_make_it_a_503_naming_them(cluster):  # noqa: F811
    for path in ("/reset_prefix_cache", "/flush_cache"):
        resp = httpx.post(cluster.url + path, timeout=15)
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["code"] == "prefix_cache_reset_failed" and "2 of 2 workers" in err["message"]
        assert "UNIMPLEMENTED" in err["message"]  # the scripted workers have no prefix cache


def test_the_api_key_guards_the_reset(cluster_factory):  # noqa: F811
    c = cluster_factory(api_key="k")
    assert httpx.post(c.url + "/reset_prefix_cache", timeout=15).status_code == 401
    resp = httpx.post(c.url + "/reset_prefix_cache", headers={"Authorization": "Bearer k"}, timeout=15)
    assert resp.status_code == 503  # authorised; the scripted workers cannot reset
