"""deploy/grafana: the provisioned dashboard parses, covers what an operator of a PD mesh needs,
its PromQL parses (promtool) and names only metrics the services define; the provisioning files
point where docker-compose.yml mounts them.

The live check (every metric in the dashboard present in a running mesh's /metrics) is
tests/integration/test_deploy_grafana_live.py.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

import yaml

from tests.unit.test_deploy_compose import COMPOSE, compose_config, need_tool
from tests.unit.test_deploy_prometheus import declared_names, metric_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "pdmesh.json"

# Grafana's built-in macros, replaced by a concrete value before promtool parses an expression.
MACROS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}

# What the dashboard must show (PD queues, TTFT/ITL/e2e, KV transfer bandwidth, token usage,
# evictions).
REQUIRED = {
    "pdmesh:num_prefill_prealloc_queue_reqs",
    "pdmesh:num_prefill_inflight_queue_reqs",
    "pdmesh:num_queue_reqs",
    "pdmesh:num_decode_prealloc_queue_reqs",
    "pdmesh:num_decode_transfer_queue_reqs",
    "pdmesh:num_running_reqs",
    "pdmesh:time_to_first_token_seconds_bucket",
    "pdmesh:inter_token_latency_seconds_bucket",
    "pdmesh:e2e_request_latency_seconds_bucket",
    "pdmesh:kv_transfer_bytes_sum",
    "pdmesh:token_usage",
    "pdmesh:watchdog_evictions_total",
    # SGLang's scheduler gauges, so its dashboard's panels have a counterpart here
    "pdmesh:gen_throughput",
    "pdmesh:num_used_tokens",
    "pdmesh:max_total_num_tokens",
    "pdmesh:queue_time_seconds_bucket",
    # the router's own series (client-side), apart from the workers'
    "pdmesh:router_num_requests_total",
    "pdmesh:router_time_to_first_token_seconds_bucket",
    "pdmesh:router_num_running_reqs",
}
# Units a panel may have for what its metrics measure (by name suffix).
UNIT_OF_SUFFIX = {"_seconds": {"s"}, "_bytes": {"bytes", "Bps"}}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep theirs inside
    return out


def expressions(dash: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    dash = dash or dashboard()
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q.strip())
            exprs.append(m.group(1) if m else q)
    return exprs


def dashboard_metric_names() -> set[str]:
    return set().union(*(metric_names(e) for e in expressions()))


def test_dashboard_parses_and_has_the_pd_panels():
    dash = dashboard()
    assert dash["uid"] == "pdmesh" and dash["title"]
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash):
        if p["type"] == "row":
            continue
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        assert p["datasource"]["uid"] == "${datasource}", f"panel {p['title']!r} pins a datasource"
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
    names = dashboard_metric_names()
    missing = REQUIRED - names
    assert not missing, f"dashboard lacks {sorted(missing)}"
    titles = " ".join(p["title"].lower() for p in panels(dash))
    for word in (
        "prefill queues",
        "decode queues",
        "time to first token",
        "inter-token",
        "end-to-end",
        "kv transfer bandwidth",
        "token usage",
        "evictions",
    ):
        assert word in titles, f"no panel about {word!r}"


def panel_metric_names(panel: dict) -> set[str]:
    return set().union(*(metric_names(t["expr"]) for t in panel.get("targets", []) if t.get("expr")))


def test_panel_units_fit_what_they_plot():
    """A seconds panel plots only seconds, a bytes panel bytes (the KV latency panel once drew the
    transfer size on its seconds axis)."""
    for p in panels(dashboard()):
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        for name in panel_metric_names(p):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            for suffix, units in UNIT_OF_SUFFIX.items():
                if base.endswith(suffix) and not p["title"].lower().endswith("speed per request"):
                    assert unit in units, f"panel {p['title']!r} ({unit}) plots {name}"
        if unit == "s":
            assert all(re.sub(r"_(bucket|sum|count)$", "", n).endswith("_seconds") for n in panel_metric_names(p)), p


def test_router_requests_panel_counts_generation_requests_only():
    (panel,) = [p for p in panels(dashboard()) if p["title"] == "Requests / s (router)"]
    assert panel_metric_names(panel) == {"pdmesh:router_num_requests_total"}


def test_no_query_mixes_router_and_worker_counts():
    """The router's series have their own names: no query selects engine_type="router" from a
    name the workers also emit (a sum over it would count each request twice)."""
    for expr in expressions():
        assert 'engine_type="router"' not in expr or "worker_healthy" in expr, expr


def test_dashboard_names_only_metrics_the_services_define():
    unknown = dashboard_metric_names() - declared_names() - {"up"}
    assert not unknown, (
        f"dashboard queries {sorted(unknown)}, which services/common/metrics.py does not define"
    )


def test_dashboard_variables_are_defined():
    dash = dashboard()
    defined = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model"} <= defined
    for expr in expressions(dash):
        for var in re.findall(r"\$\{?(\w+)", expr):
            assert var in defined or "$__" + var.removeprefix("__") in MACROS, f"${var} undefined in {expr}"


def test_dashboard_promql_parses(tmp_path):
    """promtool parses every expression (as a recording rule), macros and variables filled in."""
    promtool = need_tool("promtool", "prometheus")
    rules = []
    for i, expr in enumerate(expressions()):
        for macro, value in MACROS.items():
            expr = expr.replace(macro, value)
        expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
        rules.append({"record": f"pdmesh_dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"


def test_provisioning_matches_the_compose_mounts():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    var = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdmesh.yml").read_text())
    (provider,) = prov["providers"]
    services = compose_config(COMPOSE)["services"]
    mounts = {}
    for v in services["grafana"]["volumes"]:
        src, dst = v.split(":")[:2] if isinstance(v, str) else (v.get("source"), v["target"])
        mounts[dst] = src
    assert mounts["/etc/grafana/provisioning"].endswith("deploy/grafana/provisioning")
    assert mounts[provider["options"]["path"]].endswith("deploy/grafana/dashboards")
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name
