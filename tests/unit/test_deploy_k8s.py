"""deploy/k8s: the manifests parse as YAML, name only flags and PDMESH_* variables the services
have, give each worker one GPU and probes on its real health port, and wire the router to the
workers' headless Services. No cluster needed (kubectl is not assumed)."""

from __future__ import annotations

import pathlib

import yaml

from tests.unit.test_deploy_compose import (
    all_env_twins,
    check_env_value,
    check_service_argv,
    read_env_file,
    service_cli,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
GRPC_PORT = {"prefill": 50051, "decode": 50052}


def load(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def objects() -> dict[tuple[str, str], dict]:
    out = {}
    kust = load(K8S / "kustomization.yaml")[0]
    for res in kust["resources"]:
        for doc in load(K8S / res):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_manifest_parses_and_the_kustomization_lists_them():
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for f in files:
        docs = load(f)
        assert docs, f"{f} is empty"
        for d in docs:
            assert d.get("apiVersion") and d.get("kind"), f"{f}: not a Kubernetes object"
    kust = load(K8S / "kustomization.yaml")[0]
    listed = {K8S / r for r in kust["resources"]}
    expected = {f for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml"}
    assert listed == expected, f"kustomization.yaml lists {sorted(map(str, listed))}"
    kinds = {k for k, _ in objects()}
    assert {"Deployment", "Service", "ConfigMap", "Namespace"} <= kinds


def test_workers_get_one_gpu_each_probes_and_scrape_annotations():
    objs = objects()
    for role in ("prefill", "decode"):
        dep = objs[("Deployment", f"pdmesh-{role}")]
        tmpl = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
        (c,) = tmpl["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        http_port = int(flag_value(c["args"], "--http-port"))
        grpc_port = int(flag_value(c["args"], "--grpc-port"))
        assert grpc_port == GRPC_PORT[role]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": grpc_port, "http": http_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health" and get["port"] in ("http", http_port), f"{role} {probe}"
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(http_port)
        assert ann["prometheus.io/path"] == "/metrics"
        assert flag_value(c["args"], "--host") == "0.0.0.0"
        env = {e["name"]: e for e in c.get("env", [])}
        # unique per pod: the worker label, and the hostname part of the NIXL agent name
        assert env["PDMESH_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert tmpl["spec"]["securityContext"]["runAsNonRoot"] is True


def test_workers_have_headless_services_and_the_router_uses_them():
    objs = objects()
    for role in ("prefill", "decode"):
        svc = objs[("Service", f"pdmesh-{role}")]
        assert svc["spec"]["clusterIP"] == "None", f"pdmesh-{role} must be headless"
        dep = objs[("Deployment", f"pdmesh-{role}")]
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert ports["grpc"] == GRPC_PORT[role]
    router = objs[("Deployment", "pdmesh-router")]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert flag_value(c["args"], "--prefill") == "pdmesh-prefill:50051"
    assert flag_value(c["args"], "--decode") == "pdmesh-decode:50052"
    port = int(flag_value(c["args"], "--port"))
    svc = objs[("Service", "pdmesh-router")]
    assert svc["spec"].get("clusterIP") != "None"
    assert svc["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    # readiness follows /health (a healthy worker pair); liveness must not (no restart loops
    # while workers load or are down)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["port"] in ("http", port)
    assert c["livenessProbe"]["tcpSocket"]["port"] in ("http", port)
    ann = router["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(port)


def test_manifests_name_only_real_flags_and_env_twins():
    objs = objects()
    twins = all_env_twins()
    for (kind, name), obj in objs.items():
        if kind != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            assert "command" not in c, f"{name}: use args, so the image's tini entrypoint stays PID 1"
            role = check_service_argv(c["args"], f"k8s {name}")
            assert name == f"pdmesh-{role}"
            for e in c.get("env", []):
                if e["name"].startswith("PDMESH_"):
                    assert e["name"] in service_cli(role)[1], (
                        f"{name}: {e['name']} is not a flag twin of {role}"
                    )
                    if "value" in e:
                        check_env_value(e["name"], e["value"], f"k8s {name}")
            refs = [s["configMapRef"]["name"] for s in c.get("envFrom", []) if "configMapRef" in s]
            assert refs == ["pdmesh-env"], f"{name}: envFrom {refs}"
    cm = objs[("ConfigMap", "pdmesh-env")]["data"]
    unknown = sorted(set(cm) - twins)
    assert not unknown, f"ConfigMap pdmesh-env sets {unknown}, no service's flag twins"
    for k, v in cm.items():
        check_env_value(k, v, "ConfigMap pdmesh-env")
    # one configuration: the ConfigMap is the PDMESH_* part of deploy/pdmesh.env
    env_file = {k: v for k, v in read_env_file().items() if k.startswith("PDMESH_")}
    assert cm == env_file, "deploy/k8s/configmap.yaml and deploy/pdmesh.env disagree"


def test_podmonitor_scrapes_the_http_port_with_the_compose_job_names():
    kust = load(K8S / "monitoring" / "kustomization.yaml")[0]
    (pm,) = [d for r in kust["resources"] for d in load(K8S / "monitoring" / r) if d["kind"] == "PodMonitor"]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "http" and ep["path"] == "/metrics"
    job = next(r for r in ep["relabelings"] if r["targetLabel"] == "job")
    # pdmesh-router / -prefill / -decode, as deploy/prometheus/prometheus.yml names them (for people's
    # queries; the alerts select by engine_type, test_deploy_prometheus.py keeps them off job names)
    assert job["replacement"] == "pdmesh-$1"
    labels = pm["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode", "router"):
        tmpl = objects()[("Deployment", f"pdmesh-{role}")]["spec"]["template"]
        assert labels.items() <= tmpl["metadata"]["labels"].items()
        assert any(p["name"] == "http" for c in tmpl["spec"]["containers"] for p in c["ports"])


def test_workers_require_the_internal_token_secret_and_the_router_reads_it():
    objs = objects()
    for role in ("prefill", "decode"):
        (c,) = objs[("Deployment", f"pdmesh-{role}")]["spec"]["template"]["spec"]["containers"]
        assert flag_value(c["args"], "--host") == "0.0.0.0"  # beyond loopback: a token is a must
        (env,) = [e for e in c["env"] if e["name"] == "PDMESH_INTERNAL_TOKEN"]
        ref = env["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "pdmesh-secrets" and ref["key"] == "PDMESH_INTERNAL_TOKEN"
        assert not ref.get("optional", False), f"{role}: the pod must not start without the token"
    (router,) = objs[("Deployment", "pdmesh-router")]["spec"]["template"]["spec"]["containers"]
    assert any(src.get("secretRef", {}).get("name") == "pdmesh-secrets" for src in router["envFrom"])


def test_pods_get_no_service_link_variables():
    """Without this, a Service named pdmesh (or pdmesh-http, pdmesh-grpc) would inject
    PDMESH_PORT=tcp://IP:PORT into every pod, a PDMESH_* twin of a flag."""
    for (kind, name), obj in objects().items():
        if kind == "Deployment":
            assert obj["spec"]["template"]["spec"]["enableServiceLinks"] is False, name


def _setting(role: str, flag: str, container: dict, configmap: dict) -> float:
    """A flag's value in a pod: its argument, else its env twin (pod env, then the ConfigMap), else its default."""
    from services.common.config import DECODE_FLAGS, PREFILL_FLAGS, ROUTER_FLAGS

    flags = {"router": ROUTER_FLAGS, "prefill": PREFILL_FLAGS, "decode": DECODE_FLAGS}[role]
    (f,) = [f for f in flags if f.name == flag]
    args = container["args"]
    if f"--{flag}" in args:
        return float(flag_value(args, f"--{flag}"))
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    raw = env.get(f.env) or configmap.get(f.env)
    return float(raw) if raw else float(f.default)


def test_stops_drain_within_the_termination_grace():
    """preStop, then the router's --shutdown-timeout (streams longer than 5 s survive a router
    rollout) or a worker's --drain-timeout (longer than 2 s), with the supervisor's margin, all
    inside terminationGracePeriodSeconds."""
    from services.router.processes import STOP_MARGIN

    objs = objects()
    cm = objs[("ConfigMap", "pdmesh-env")]["data"]
    for role, flag, floor in (("router", "shutdown-timeout", 5), ("prefill", "drain-timeout", 2),
                              ("decode", "drain-timeout", 2)):
        spec = objs[("Deployment", f"pdmesh-{role}")]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        pre_stop = float(command[1])
        timeout = _setting(role, flag, c, cm)
        assert timeout > floor, f"{role}: --{flag} {timeout}"
        assert pre_stop + timeout + STOP_MARGIN <= spec["terminationGracePeriodSeconds"], role


def test_every_role_has_a_disruption_budget_of_one_pod():
    objs = objects()
    for role in ("router", "prefill", "decode"):
        pdb = objs[("PodDisruptionBudget", f"pdmesh-{role}")]
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
        labels = objs[("Deployment", f"pdmesh-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
