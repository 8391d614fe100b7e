"""The metrics of real router, prefill and decode processes, scraped over HTTP and parsed with the
Prometheus text parser: one served model_name on every role, router series under their own
names (so a sum over a worker name counts each request once), SGLang's gauges, and a worker's
/metrics and /health answering while its model loads."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.http_client import post_json
from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration

SERVED = "team-model"
LOAD_SECONDS = 6.0


def samples(url: str) -> list:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def total(all_samples: list, name: str) -> float:
    return sum(s.value for s in all_samples if s.name == name)


def test_one_model_name_and_no_double_counting_across_roles(mesh):
    env = {"PDMESH_SERVED_MODEL_NAME": SERVED}  # the one setting the env file gives every service
    p = mesh.start_prefill(env=env, wait=False)
    d = mesh.start_decode(env=env, wait=False)
    mesh.wait_healthy(p)
    mesh.wait_healthy(d)
    r = mesh.start_router([p], [d], env=env)
    tokens = 0
    for i in range(4):
        out = post_json(r.http_url, "/v1/completions",
                        {"model": SERVED, "prompt": f"A question {i}", "max_tokens": 6, "ignore_eos": True})
        tokens += out["usage"]["completion_tokens"]
    scraped = {proc.role: samples(proc.http_url) for proc in (p, d, r)}
    everything = [s for ss in scraped.values() for s in ss]

    for role, ss in scraped.items():
        names = {s.labels["model_name"] for s in ss if "model_name" in s.labels}
        assert names == {SERVED}, f"{role} labels model_name {names}"

    # a sum over the worker names counts each request and token once; the router has its own
    assert total(everything, "pdmesh:generation_tokens_total") == tokens
    assert total(scraped["router"], "pdmesh:router_generation_tokens_total") == tokens
    assert total(everything, "pdmesh:num_requests_total") == 8  # 4 on prefill, 4 on decode, none on the router
    assert total(scraped["router"], "pdmesh:router_num_requests_total") == 4
    assert total(everything, "pdmesh:time_to_first_token_seconds_count") == 4  # decode's
    assert total(scraped["router"], "pdmesh:router_time_to_first_token_seconds_count") == 4
    assert not [s for s in everything if s.labels.get("engine_type") == "router"
                and s.name.startswith(("pdmesh:num_requests", "pdmesh:generation_tokens",
                                       "pdmesh:time_to_first_token", "pdmesh:e2e_request_latency"))]

    # SGLang's gauges, from the roles that own them
    pool = {s.name: s.value for s in scraped["decode"]}
    assert pool["pdmesh:max_total_num_tokens"] > 0 and pool["pdmesh:num_used_tokens"] == 0
    assert pool["pdmesh:gen_throughput"] > 0  # tokens were generated in the last 10 s
    assert total(scraped["prefill"], "pdmesh:queue_time_seconds_count") == 4
    assert total(scraped["decode"], "pdmesh:queue_time_seconds_count") == 4
    assert total(scraped["prefill"], "pdmesh:kv_transfer_latency_ms") > 0
    itl = [s for s in scraped["decode"] if s.name == "pdmesh:inter_token_latency_seconds_bucket"]
    assert {"0.001", "0.002", "0.005", "0.01"} <= {s.labels["le"] for s in itl}
    mesh.assert_invariants()


def test_a_loading_worker_answers_metrics_and_health(mesh):
    """While the model loads, /health is 503 "loading" and /metrics parses with pdmesh:up 0, so
    probes and scrapes see a worker loading, not a worker down; then it serves (200, up 1)."""
    d = mesh.start_decode("--faults", f"slow_load={LOAD_SECONDS}", "--served-model-name", SERVED, wait=False)
    seen = []

    def answered_loading():
        assert d.alive(), d.log()[-3000:]
        try:
            resp = httpx.get(d.http_url + "/health", timeout=2)
        except httpx.HTTPError:
            return False
        seen.append(resp.status_code)
        return resp.status_code == 503 and resp.json()["status"] == "loading"

    wait_for(answered_loading, 60, "decode's /health to answer 'loading'", poll=0.05)
    body = httpx.get(d.http_url + "/health", timeout=2).json()
    assert body["role"] == "decode" and body["model"] == SERVED, body
    up = [s for s in samples(d.http_url) if s.name == "pdmesh:up"]
    assert [(s.value, s.labels["model_name"], s.labels["engine_type"]) for s in up] == [(0.0, SERVED, "decode")]
    mesh.wait_healthy(d)
    assert [s.value for s in samples(d.http_url) if s.name == "pdmesh:up"] == [1.0]
    assert 200 not in seen  # never ready before it loaded
