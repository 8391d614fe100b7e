"""A real Prometheus (Debian package `prometheus`), started by the test on a free port with its
own data folder, scrapes a live mesh using deploy/prometheus/prometheus.yml and alerts.yml
(targets rewritten to the test's ports, intervals shortened).

The seed scenario: decode freezes (SIGSTOP) right after attaching the room; no further traffic.
Prefill's pdmesh:num_prefill_inflight_queue_reqs, read back through Prometheus' HTTP API, goes
0 -> 1 -> 0 (the watchdog evicts the room after --inflight-timeout), the eviction counter
reaches 1, and the alert rules react (evictions rising; decode down).
"""

from __future__ import annotations

import asyncio
import copy
import os
import pathlib
import signal
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from services.launch.ports import free_port
from tests.integration.mesh import wait_for
from tests.unit.test_deploy_compose import need_tool

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
INFLIGHT_TIMEOUT, WATCHDOG_INTERVAL = 2.0, 0.5
SCRAPE = "500ms"
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def config_for(targets: dict[str, str]) -> dict:
    """deploy/prometheus/prometheus.yml with each pdmesh job's targets replaced by `targets`
    (job -> host:port) and intervals short enough for a test."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg = copy.deepcopy(cfg)
    cfg["global"].update(scrape_interval=SCRAPE, scrape_timeout="400ms", evaluation_interval=SCRAPE)
    cfg["rule_files"] = [str(PROM_DIR / f) for f in cfg["rule_files"]]
    jobs = []
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        if name not in targets:
            continue  # e.g. Prometheus scraping itself
        labels = {}
        for sc in job.pop("static_configs", []):
            labels.update(sc.get("labels", {}))
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [targets[name]], **({"labels": labels} if labels else {})}]
        jobs.append(job)
    assert {j["job_name"] for j in jobs} == set(targets), "prometheus.yml lacks a pdmesh job"
    cfg["scrape_configs"] = jobs
    return cfg


class Prometheus:
    def __init__(self, tmp_path: pathlib.Path, cfg: dict):
        exe = need_tool("prometheus", "prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.log_path = tmp_path / "prometheus.log"
        self.popen = subprocess.Popen(
            [
                exe,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        def ready():
            assert self.popen.poll() is None, f"prometheus exited:\n{self.log_path.read_text()[-3000:]}"
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200

        wait_for(ready, timeout, "prometheus to be ready", poll=0.1)

    def api(self, path: str, **params):
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=5)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        return self.api("query", query=promql)["result"]

    def close(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)


@pytest.fixture
def prometheus_factory(tmp_path):
    started: list[Prometheus] = []

    def start(targets: dict[str, str]) -> Prometheus:
        p = Prometheus(tmp_path, config_for(targets))
        started.append(p)
        p.wait_ready()
        return p

    try:
        yield start
    finally:
        for p in started:
            p.close()


def test_prometheus_sees_inflight_go_1_then_0_in_the_seed_scenario(mesh, prometheus_factory):
    need_tool("prometheus", "prometheus")
    p = mesh.start_prefill(
        "--inflight-timeout", str(INFLIGHT_TIMEOUT), "--watchdog-interval", str(WATCHDOG_INTERVAL),
        # decode is frozen before the WRITE: the forward outlasts its handling of the Attach reply
        "--faults", "delay_forward=1", wait=False,
    )
    d = mesh.start_decode("--faults", "sigstop_after_attach", wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    r = mesh.start_router([p], [d])
    prom = prometheus_factory(
        {
            "pdmesh-prefill": f"127.0.0.1:{p.http_port}",
            "pdmesh-decode": f"127.0.0.1:{d.http_port}",
            "pdmesh-router": f"127.0.0.1:{r.http_port}",
        }
    )
    inflight = 'pdmesh:num_prefill_inflight_queue_reqs{job="pdmesh-prefill"}'

    def value_of(promql):
        res = prom.query(promql)
        return float(res[0]["value"][1]) if res else None

    # every target is scraped, and the prefill worker's inflight gauge is there, at 0
    wait_for(
        lambda: len([t for t in prom.api("targets")["activeTargets"] if t["health"] == "up"]) == 3,
        20,
        "prometheus to scrape router, prefill and decode",
    )
    wait_for(lambda: value_of(inflight) == 0, 20, "prometheus to report prefill's inflight gauge at 0")
    (series,) = prom.query(inflight)
    assert series["metric"]["engine_type"] == "prefill" and series["metric"]["worker"], series["metric"]
    started = time.time()

    # one request; decode freezes right after attaching it; nothing else is sent
    box: dict = {}
    thread = threading.Thread(
        target=lambda: box.setdefault(
            "out", asyncio.run(generate(p.grpc_addr, d.grpc_addr, list(range(10, 60)), PARAMS, timeout=60))
        ),
        daemon=True,
    )
    thread.start()
    wait_for(
        lambda: value_of(inflight) == 1,
        60,
        "prometheus to report 1 request in prefill's inflight queue",
        poll=0.1,
    )
    seen_one = time.monotonic()
    wait_for(
        lambda: value_of(inflight) == 0,
        INFLIGHT_TIMEOUT + WATCHDOG_INTERVAL + 5,
        "inflight back to 0",
        poll=0.1,
    )
    print(f"prometheus saw inflight 1 -> 0 in {time.monotonic() - seen_one:.2f}s")

    # the stored series reads 0 ... 1 ... 0 (the query range must reach past the newest sample)
    def history():
        data = prom.api("query_range", query=inflight, start=started - 2, end=time.time(), step="0.25")
        (rng,) = data["result"]
        values = [float(v) for _, v in rng["values"]]
        return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]

    wait_for(lambda: history() == [0.0, 1.0, 0.0], 5, "the stored inflight series to read 0, 1, 0", poll=0.25)
    for _ in range(4):  # and it stays 0 with no further traffic
        time.sleep(0.5)
        assert history() == [0.0, 1.0, 0.0], history()

    # the watchdog evicted it, and the Prefill RPC failed
    evictions = 'pdmesh:watchdog_evictions_total{job="pdmesh-prefill",queue="inflight"}'
    wait_for(lambda: value_of(evictions) == 1, 10, "prometheus to report 1 inflight eviction")
    wait_for(lambda: "out" in box, 30, "the Prefill RPC to end")
    assert box["out"].prefill_error is not None, "the Prefill RPC of the frozen room should fail"
    thread.join(timeout=10)

    # the alert rules react: evictions rising (prefill, inflight) and the frozen decode is down
    def alerts():
        return {
            (a["labels"]["alertname"], a["labels"].get("job"), a["labels"].get("queue")): a["state"]
            for a in prom.api("alerts")["alerts"]
        }

    wait_for(
        lambda: ("PDMeshWatchdogEvictions", "pdmesh-prefill", "inflight") in alerts(),
        10,
        "the watchdog-evictions alert",
    )
    wait_for(
        lambda: ("PDMeshWorkerDown", "pdmesh-decode", None) in alerts(),
        10,
        "the worker-down alert for decode",
    )
    assert all(state in ("pending", "firing") for state in alerts().values())
    assert ("PDMeshWorkerDown", "pdmesh-prefill", None) not in alerts()

    # decode resumes: every queue drains and both pools are whole again
    d.cont()
    mesh.assert_invariants()
    rules = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
    assert all(r["health"] == "ok" for r in rules.values()), {n: r.get("lastError") for n, r in rules.items()}
