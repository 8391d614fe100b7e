"""The alert rules (deploy/prometheus/alerts.yml) run by `promtool test rules` on the series a live
mesh really emits: router, prefill and decode processes serve a few requests, their /metrics are
scraped and parsed with the Prometheus text parser, and every scraped sample becomes an input
series of the rule tests, labelled as an annotation-based Kubernetes scrape would label it (job
"kubernetes-pods", instance the pod's address). On that baseline each scenario changes only what
it is about:

- a decode is killed: PDMeshWorkerDown fires for it (by its engine_type and worker labels) and,
  it being the only decode, PDMeshNoDecodeWorker;
- a 5xx burst on the router: PDMeshRouter5xxRatio;
- time to first token over the 2 s objective: PDMeshTTFTOverSLO;
- a rolling restart of every role (each new process loads its model for 3 minutes, /metrics
  answering with pdmesh:up 0, then serves; the old one then goes): no alert fires at any time.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.http_client import post_json
from tests.unit.test_deploy_compose import need_tool

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
JOB = "kubernetes-pods"
STEPS = 60  # input samples per series, 30 s apart: 30 minutes
SLO = 2.0  # pdmesh:ttft_slo_seconds' default


Sample = tuple[str, dict[str, str], float]


def scrape(url: str, instance: str) -> list[Sample]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue  # a creation timestamp, no rule reads it
            out.append((s.name, {**s.labels, "job": JOB, "instance": instance}, s.value))
    return out


def series(name: str, labels: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return name + "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def flat(value: float, steps: int = STEPS) -> str:
    return f"{value!r}x{steps - 1}"


def find(samples: list[Sample], name: str, **labels) -> tuple[str, dict[str, str], float]:
    found = [s for s in samples if s[0] == name and labels.items() <= s[1].items()]
    assert found, f"the live mesh emits no {name}{labels}"
    return found[0]


def annotations(alert: str, labels: dict[str, str], value: str = "") -> dict[str, str]:
    """The alert's annotations as Prometheus renders them, for the label and value templates the
    rules use."""
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == alert]
    out = {}
    for key, template in rule.get("annotations", {}).items():
        text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
        text = re.sub(r"\{\{\s*\$value[^}]*\}\}", value, text)
        out[key] = text
    return out


def expect(alert: str, at: str, labels: list[dict[str, str]], value: str = "") -> dict:
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == alert]
    return {"eval_time": at, "alertname": alert, "exp_alerts": [
        {"exp_labels": {**rule.get("labels", {}), **ls}, "exp_annotations": annotations(alert, ls, value)}
        for ls in labels]}


def quiet(at: str) -> list[dict]:
    names = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    return [{"eval_time": at, "alertname": n, "exp_alerts": []} for n in names]


def baseline(samples: list[Sample], skip=lambda name, labels: False) -> dict[str, str]:
    """Every live sample as a flat series (counters hold still: nothing happens)."""
    return {series(n, ls): flat(v) for n, ls, v in samples if not skip(n, ls)}


def test_alerts_fire_and_stay_quiet_on_the_series_a_live_mesh_emits(mesh, tmp_path):
    promtool = need_tool("promtool", "prometheus")
    (p,), (d,) = mesh.start_workers(1, 1)
    r = mesh.start_router([p], [d])
    for i in range(3):
        post_json(r.http_url, "/v1/completions", {"model": "pdmesh-tiny", "prompt": f"Hello {i}", "max_tokens": 4})
    httpx.get(r.http_url + "/v1/models", timeout=10)
    instances = {"prefill": "10.0.0.11:8081", "decode": "10.0.0.12:8082", "router": "10.0.0.13:8000"}
    live: list[Sample] = []
    for proc in (p, d, r):
        live += scrape(proc.http_url, instances[proc.role])
    mesh.assert_invariants()

    ups = {role: {"job": JOB, "instance": inst} for role, inst in instances.items()}
    _, d_up, _ = find(live, "pdmesh:up", engine_type="decode")
    _, ok_labels, ok_count = find(live, "pdmesh:router_requests_total", status="200")
    ttft_buckets = [(ls, v) for n, ls, v in live if n == "pdmesh:router_time_to_first_token_seconds_bucket"]
    assert ttft_buckets and d_up["worker"] and d_up["model_name"] == ok_labels["model_name"] == "pdmesh-tiny"
    model = ok_labels["model_name"]
    tests = []

    # --- a decode is killed: its scrapes fail from 1 minute on, its series go stale ----------------
    s = baseline(live, skip=lambda n, ls: ls["instance"] == instances["decode"])
    s.update({series("up", ups[role]): flat(1) for role in ("prefill", "router")})
    s[series("up", ups["decode"])] = "1 1 0x57"
    for n, ls, v in live:
        if ls["instance"] == instances["decode"]:
            s[series(n, ls)] = f"{v!r} {v!r} stale"
    down = {"job": JOB, "instance": instances["decode"], "engine_type": "decode", "worker": d_up["worker"]}
    tests.append({"interval": "30s", "input_series": [{"series": k, "values": v} for k, v in s.items()],
                  "alert_rule_test": [
                      {"eval_time": "1m30s", "alertname": "PDMeshWorkerDown", "exp_alerts": []},
                      expect("PDMeshWorkerDown", "3m", [down]),
                      expect("PDMeshNoDecodeWorker", "5m", [{}]),
                      {"eval_time": "5m", "alertname": "PDMeshNoPrefillWorker", "exp_alerts": []},
                  ]})

    # --- a 5xx burst: 20 % of the router's responses are 503 from minute 5 to minute 20 ----------
    s = baseline(live, skip=lambda n, ls: n == "pdmesh:router_requests_total")
    s.update({series("up", u): flat(1) for u in ups.values()})
    s[series("pdmesh:router_requests_total", ok_labels)] = f"{ok_count!r}+40x{STEPS - 1}"
    s[series("pdmesh:router_requests_total", {**ok_labels, "status": "503"})] = "0x10 0+10x30 300x17"
    tests.append({"interval": "30s", "input_series": [{"series": k, "values": v} for k, v in s.items()],
                  "alert_rule_test": [
                      {"eval_time": "4m", "alertname": "PDMeshRouter5xxRatio", "exp_alerts": []},
                      expect("PDMeshRouter5xxRatio", "12m", [{"model_name": model}], "20%"),
                      {"eval_time": "29m", "alertname": "PDMeshRouter5xxRatio", "exp_alerts": []},
                  ]})

    # --- every first token takes longer than the objective (in the bucket just above it) --------
    bounds = sorted(float(ls["le"]) for ls, _ in ttft_buckets if ls["le"] != "+Inf")
    upper = next(b for b in bounds if b > SLO)
    lower = max(b for b in bounds if b < upper)
    s = baseline(live, skip=lambda n, ls: n.startswith("pdmesh:router_time_to_first_token_seconds"))
    s.update({series("up", u): flat(1) for u in ups.values()})
    for ls, v in ttft_buckets:
        le = float(ls["le"])  # "+Inf" parses as inf
        s[series("pdmesh:router_time_to_first_token_seconds_bucket", ls)] = (
            f"{v!r}+10x{STEPS - 1}" if le >= upper else flat(v))
    p90 = lower + 0.9 * (upper - lower)
    tests.append({"interval": "30s", "input_series": [{"series": k, "values": v} for k, v in s.items()],
                  "alert_rule_test": [
                      {"eval_time": "3m", "alertname": "PDMeshTTFTOverSLO", "exp_alerts": []},
                      expect("PDMeshTTFTOverSLO", "9m", [{"model_name": model}], f"{p90:.4g}s"),
                  ]})

    # --- a rolling restart of each role under steady traffic: nothing fires ----------------------
    # Per role: the new process appears at minute 1 (pdmesh:up 0 while it loads for 3 minutes),
    # serves from minute 4; the old one drains and goes at minute 5. Requests keep succeeding.
    s = {}
    for role, inst in instances.items():
        new_inst = inst.replace("10.0.0.", "10.0.1.")
        s[series("up", ups[role])] = "1x10 stale"
        s[series("up", {**ups[role], "instance": new_inst})] = f"_ _ 1x{STEPS - 3}"
        for n, ls, v in live:
            if ls["instance"] != inst:
                continue
            old_values = f"{v!r}x10 stale"
            new_ls = {**ls, "instance": new_inst, "worker": ls["worker"] + "-new"}
            if n == "pdmesh:up" and role != "router":
                new_values = f"_ _ 0x5 1x{STEPS - 8}"
            elif n == "pdmesh:router_requests_total" and ls.get("status") == "200":
                old_values = f"{v!r}+40x10 stale"
                new_values = f"_ _ 0+40x{STEPS - 3}"
            else:
                new_values = f"_ _ {flat(v, STEPS - 2)}"
            s[series(n, ls)] = old_values
            s[series(n, new_ls)] = new_values
    steps = [quiet(at) for at in ("1m", "2m", "3m", "4m", "5m", "6m", "8m", "12m", "20m")]
    tests.append({"interval": "30s", "input_series": [{"series": k, "values": v} for k, v in s.items()],
                  "alert_rule_test": [t for at in steps for t in at]})

    test_file = tmp_path / "alerts_live_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "30s", "tests": tests},
                                        sort_keys=False, width=200))
    proc = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"promtool test rules {test_file}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
