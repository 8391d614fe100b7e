"""Against a running mesh (router + prefill + decode, real processes): every metric the Grafana
dashboard and the alert rules query is in the services' live /metrics, and deploy/healthcheck.py
(the image's HEALTHCHECK) passes for each of them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.integration.mesh import mesh_with_router
from tests.unit.test_deploy_grafana import REQUIRED, dashboard_metric_names
from tests.unit.test_deploy_prometheus import RULES, exported_names, metric_names, recorded_names

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One router + prefill + decode for this module's tests (killed at the end)."""
    with mesh_with_router(tmp_path_factory.mktemp("deploy-mesh")) as (m, (p,), (d,), r):
        yield p, d, r
        m.assert_invariants()  # after the module's scenarios: queues empty, pools whole


def test_dashboard_and_alert_metrics_exist_in_live_metrics(live):
    p, d, r = live

    # one real request through the router, so histograms and counters carry samples
    model = httpx.get(r.http_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    resp = httpx.post(
        r.http_url + "/v1/completions",
        json={"model": model, "prompt": "Hello, mesh", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    for proc in (p, d):  # the request left nothing behind
        h = proc.health()
        assert h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]

    live: dict[str, set[str]] = {}
    for proc in (p, d, r):
        text = httpx.get(proc.http_url + "/metrics", timeout=10).text
        live[proc.role] = exported_names(text)
    everywhere = set().union(*live.values())

    alert_names = set().union(
        *(
            metric_names(rule["expr"])
            for g in yaml.safe_load(RULES.read_text())["groups"]
            for rule in g["rules"]
        )
    ) - recorded_names()  # the rules' own parameters, not scraped
    for what, names in (("dashboard", dashboard_metric_names()), ("alerts.yml", alert_names)):
        missing = sorted(n for n in names - {"up"} if n not in everywhere)
        assert not missing, (
            f"{what} queries {missing}, absent from the live /metrics of router, prefill and decode"
        )

    # the role-specific gauges the dashboard shows come from the role that owns them
    for name in REQUIRED:
        if "prefill" in name:
            assert name in live["prefill"], name
        if "decode" in name:
            assert name in live["decode"], name

    # after a request: the latency histograms have samples somewhere (not only # TYPE lines)
    texts = "".join(httpx.get(proc.http_url + "/metrics", timeout=10).text for proc in (p, d, r))
    for hist in (
        "pdmesh:time_to_first_token_seconds_bucket",
        "pdmesh:e2e_request_latency_seconds_bucket",
        "pdmesh:kv_transfer_bytes_bucket",
    ):
        assert f"\n{hist}{{" in texts, f"no sample of {hist} after a request"


def test_image_healthcheck_script_passes_for_every_live_service(live):
    p, d, r = live
    for proc in (p, d, r):
        res = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "healthcheck.py")],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "PDMESH_HEALTH_URL": proc.http_url + "/health"},
        )
        assert res.returncode == 0, f"{proc.role}: {res.stderr}"
    # a frozen worker is unhealthy (times out), not healthy
    d.stop()
    try:
        res = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "healthcheck.py")],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "PDMESH_HEALTH_URL": d.http_url + "/health", "PDMESH_HEALTH_TIMEOUT": "1"},
        )
        assert res.returncode == 1
    finally:
        d.cont()
