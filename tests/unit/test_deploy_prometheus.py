"""deploy/prometheus: promtool accepts the config and the rules, the alert rules pass their unit
tests, the scrape jobs match the compose services, and the rules name only real metrics.

The live check (a real Prometheus scraping a running mesh) is
tests/integration/test_deploy_prometheus_live.py.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import yaml

from services.common.metrics import Metrics
from tests.unit.test_deploy_compose import COMPOSE, compose_config, need_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
CONFIG = PROM / "prometheus.yml"
RULES = PROM / "alerts.yml"
RULE_TESTS = PROM / "tests" / "alerts_test.yml"

JOBS = {
    "pdmesh-router": ("router", 8000),
    "pdmesh-prefill": ("prefill", 8081),
    "pdmesh-decode": ("decode", 8082),
}
REQUIRED_ALERTS = {"PDMeshInflightStuck", "PDMeshWatchdogEvictions", "PDMeshWorkerDown", "PDMeshNoPrefillWorker",
                   "PDMeshNoDecodeWorker", "PDMeshRouter5xxRatio", "PDMeshRouterRejecting429", "PDMeshTTFTOverSLO"}

# PromQL words that are not metric names
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "rate",
    "irate",
    "increase",
    "delta",
    "absent",
    "histogram_quantile",
    "last_over_time",
    "max_over_time",
    "min_over_time",
    "avg_over_time",
    "label_values",
    "le",
    "topk",
    "bottomk",
    "clamp_min",
    "clamp_max",
    "vector",
    "time",
    "changes",
    "resets",
    "inf",
    "nan",
}


def exported_names(exposition: str) -> set[str]:
    """Every sample name a /metrics exposition can carry, from its # TYPE lines and samples
    (a labelled metric with no child yet has a TYPE line and no sample)."""
    names: set[str] = set()
    for line in exposition.splitlines():
        m = re.match(r"# TYPE (\S+) (\w+)", line)
        if m:
            name, kind = m.groups()
            if kind == "counter":
                base = name.removesuffix("_total")
                names |= {base + "_total", base + "_created"}
            elif kind in ("histogram", "summary"):
                names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{\s]+", line).group(0))
    return names


def declared_names() -> set[str]:
    """What services/common/metrics.py exports, over all three roles."""
    out: set[str] = set()
    for role in ("prefill", "decode", "router"):
        out |= exported_names(Metrics(role, "m", "w").exposition().decode())
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (pdmesh:* and Prometheus' own `up`)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # drop string literals (label values)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # drop label matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # drop ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(
        r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+|ms|[smhdwy])?(?![\w:])", " ", expr
    )  # numbers, durations
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return words - PROMQL_WORDS


def test_promtool_check_config_and_rules():
    promtool = need_tool("promtool", "prometheus")
    for args in (["check", "config", str(CONFIG)], ["check", "rules", str(RULES)]):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def test_alert_rules_pass_their_unit_tests():
    """Inflight stuck with no decode progress > 2 min, watchdog evictions rising, a worker down:
    each fires when it should and stays quiet otherwise (deploy/prometheus/tests/alerts_test.yml)."""
    promtool = need_tool("promtool", "prometheus")
    proc = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"promtool test rules:\n{proc.stdout}\n{proc.stderr}"
    tested = set(re.findall(r"alertname:\s*(\w+)", RULE_TESTS.read_text()))
    defined = {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r
    }
    assert REQUIRED_ALERTS <= defined
    assert defined <= tested, f"alerts without a unit test: {sorted(defined - tested)}"


def recorded_names() -> set[str]:
    return {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}


def test_alert_rules_name_only_exported_metrics():
    declared = declared_names() | {"up"} | recorded_names()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            names = metric_names(rule["expr"])
            assert names or "record" in rule, rule["expr"]  # a parameter records a constant
            unknown = names - declared
            assert not unknown, (
                f"{rule.get('alert')}: {sorted(unknown)} not exported by services/common/metrics.py"
            )


def test_scrape_jobs_cover_the_three_services_on_their_compose_ports():
    cfg = yaml.safe_load(CONFIG.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert set(JOBS) <= set(jobs)
    compose = compose_config(COMPOSE)["services"]
    for job, (service, port) in JOBS.items():
        j = jobs[job]
        assert j.get("metrics_path", "/metrics") == "/metrics"
        targets = [t for sc in j.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in j.get("dns_sd_configs", []) for n in sd["names"]]
        assert targets == [f"{service}:{port}"], f"{job}: {targets}"
        assert service in compose
        argv = compose[service]["command"]
        flag = "--port" if service == "router" else "--http-port"
        assert argv[argv.index(flag) + 1] == str(port), (
            f"{job} scrapes :{port}, {service} serves HTTP on {argv}"
        )
    assert cfg["rule_files"] == ["alerts.yml"]
    # the compose file mounts this folder where the config expects it
    mounts = [
        v if isinstance(v, str) else f"{v.get('source')}:{v['target']}"
        for v in compose["prometheus"]["volumes"]
    ]
    assert any(re.match(r".*/deploy/prometheus:/etc/prometheus(:ro)?$", v) for v in mounts), mounts


def test_alerts_select_targets_by_the_mesh_labels_not_job_names():
    """Annotation-based scraping names its job as it likes: no alert may depend on pdmesh-* jobs."""
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert "job=" not in rule["expr"].replace(" ", ""), rule.get("alert") or rule.get("record")


def test_ttft_objective_is_a_parameter_of_two_seconds_by_default():
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
               if r.get("record") == "pdmesh:ttft_slo_seconds"]
    assert rule["expr"].strip() == "vector(2)"
    (alert,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == "PDMeshTTFTOverSLO"]
    assert "pdmesh:ttft_slo_seconds" in alert["expr"] and "pdmesh:router_time_to_first_token" in alert["expr"]


def test_prometheusrule_is_the_rules_file():
    """deploy/k8s/monitoring/prometheusrule.yaml carries exactly deploy/prometheus/alerts.yml's groups
    (scripts/gen_prometheusrule.py writes it) and the monitoring kustomization applies it."""
    k8s_monitoring = ROOT / "deploy" / "k8s" / "monitoring"
    (rule,) = [d for d in yaml.safe_load_all((k8s_monitoring / "prometheusrule.yaml").read_text()) if d]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    kust = yaml.safe_load((k8s_monitoring / "kustomization.yaml").read_text())
    assert "prometheusrule.yaml" in kust["resources"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_prometheusrule.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
