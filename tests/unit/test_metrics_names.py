"""services/common/metrics.py: SGLang's names on the workers (former names kept as aliases with
the same samples), the router's series under names of their own, ITL buckets fine enough for GPU
decode, and gen_throughput's sliding window."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import ITL_BUCKETS, RENAMED, Metrics, observe_many
from services.common.rate_window import RateWindow


def families(m: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}


def sample_names(m: Metrics) -> set[str]:
    text = m.exposition().decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}


SGLANG_WORKER_NAMES = {
    "prefill": {"num_prefill_prealloc_queue_reqs", "num_prefill_inflight_queue_reqs", "num_queue_reqs",
                "num_running_reqs", "token_usage", "num_used_tokens", "max_total_num_tokens", "queue_time_seconds",
                "kv_transfer_latency_ms", "kv_transfer_speed_gb_s", "kv_transfer_total_mb", "prompt_tokens_total",
                "num_bootstrap_failed_reqs_total", "num_transfer_failed_reqs_total"},
    "decode": {"num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs", "num_running_reqs",
               "num_retracted_reqs", "num_retracted_requests_total", "token_usage", "num_used_tokens",
               "max_total_num_tokens", "gen_throughput", "queue_time_seconds", "generation_tokens_total",
               "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"},
}


def test_workers_export_sglang_names():
    for role, names in SGLANG_WORKER_NAMES.items():
        exported = sample_names(Metrics(role, "m", "w"))
        missing = {"pdmesh:" + n for n in names} - exported
        assert not missing, f"{role} lacks {sorted(missing)}"


def test_renamed_series_keep_their_former_name_with_the_same_samples():
    p = Metrics("prefill", "m", "p0")
    p.gauge_from("num_prefill_prealloc_queue_reqs", lambda: 3)
    d = Metrics("decode", "m", "d0")
    d.inc(d.num_retractions, 2)
    fp, fd = families(p), families(d)
    assert fp["pdmesh:num_prefill_bootstrap_queue_reqs"].samples[0].value == 3
    assert fp["pdmesh:num_prefill_prealloc_queue_reqs"].samples[0].value == 3
    old = [s for s in fd["pdmesh:num_retractions"].samples if s.name.endswith("_total")]
    new = [s for s in fd["pdmesh:num_retracted_requests"].samples if s.name.endswith("_total")]
    assert [s.value for s in old] == [s.value for s in new] == [2.0]
    assert old[0].labels == new[0].labels
    assert set(RENAMED) == {"num_prefill_bootstrap_queue_reqs", "num_retractions"}


def test_router_series_never_share_a_name_with_the_workers():
    """A sum() over a worker name must not add the router's count of the same requests."""
    router = sample_names(Metrics("router", "m", "r0"))
    r = Metrics("router", "m", "r0")
    r.inc(r.num_requests)
    r.inc(r.generation_tokens, 5)
    r.observe(r.time_to_first_token, 0.1)
    f = families(r)
    for name in ("pdmesh:router_num_requests", "pdmesh:router_generation_tokens",
                 "pdmesh:router_time_to_first_token_seconds", "pdmesh:router_inter_token_latency_seconds",
                 "pdmesh:router_e2e_request_latency_seconds", "pdmesh:router_num_running_reqs"):
        assert name in f, name
    for worker_name in ("pdmesh:num_requests_total", "pdmesh:generation_tokens_total",
                        "pdmesh:time_to_first_token_seconds", "pdmesh:prompt_tokens_total",
                        "pdmesh:num_running_reqs", "pdmesh:e2e_request_latency_seconds"):
        assert worker_name not in router, worker_name


def test_every_role_labels_the_model_it_is_given():
    for role in ("prefill", "decode", "router"):
        m = Metrics(role, "served-name", "x")
        assert {s.labels["model_name"] for s in families(m)["pdmesh:up"].samples} == {"served-name"}


def test_one_served_name_setting_gives_every_role_the_same_model_name(monkeypatch):
    """The env file gives every role the same PDMESH_SERVED_MODEL_NAME; with several names the
    router labels its metrics with the first, and so must the workers."""
    from services.common.config import DecodeSettings, RouterSettings, parse_settings
    from services.common.model_name import served_name
    from services.router import model_controls

    monkeypatch.setenv("PDMESH_SERVED_MODEL_NAME", "team-model, team-model-v2")
    router = parse_settings(RouterSettings, "router", "test", [])
    worker = parse_settings(DecodeSettings, "decode", "test", [])
    router_name = model_controls.served_names(router.model, router.served_model_name, served_name(router.model))[0]
    assert served_name(worker.model, worker.served_model_name) == router_name == "team-model"
    assert served_name("builtin", "") == served_name("builtin", " , ") == "pdmesh-tiny"


def test_itl_buckets_resolve_one_to_ten_milliseconds():
    inside = [b for b in ITL_BUCKETS if 0.001 <= b <= 0.010]
    assert len(inside) >= 10 and all(round(b2 - b1, 6) <= 0.001 for b1, b2 in zip(inside, inside[1:], strict=False))
    assert list(ITL_BUCKETS) == sorted(ITL_BUCKETS)
    d = Metrics("decode", "m", "d0")
    d.observe(d.inter_token_latency, 0.0035)
    buckets = {s.labels["le"]: s.value for s in families(d)["pdmesh:inter_token_latency_seconds"].samples
               if s.name.endswith("_bucket")}
    assert buckets["0.003"] == 0 and buckets["0.004"] == 1


def test_pdmesh_up_is_0_while_a_worker_loads_and_1_once_it_serves():
    d = Metrics("decode", "m", "d0")
    assert families(d)["pdmesh:up"].samples[0].value == 0
    d.set_serving(True)
    assert families(d)["pdmesh:up"].samples[0].value == 1
    assert families(Metrics("router", "m", "r0"))["pdmesh:up"].samples[0].value == 1


def test_gen_throughput_is_tokens_per_second_over_its_window():
    now = [100.5]
    w = RateWindow(10.0, clock=lambda: now[0])
    assert w.rate() == 0
    for _ in range(10):  # 30 tokens at 100.5, 101.5, ... 109.5
        w.add(30)
        now[0] += 1.0
    now[0] = 109.9
    assert w.rate() == 30.0  # 300 tokens in the last 10 s
    now[0] += 5.0
    assert w.rate() == 15.0  # only the last 5 s of them still count
    now[0] += 10.0
    assert w.rate() == 0.0


def test_gen_throughput_gauge_follows_generated_tokens():
    d = Metrics("decode", "m", "d0")
    d.generated_tokens(40)
    f = families(d)
    assert f["pdmesh:gen_throughput"].samples[0].value == 4.0  # 40 tokens over the 10 s window
    assert [s.value for s in f["pdmesh:generation_tokens"].samples if s.name.endswith("_total")] == [40.0]


# What SGLang's own Grafana dashboard (examples/monitoring/grafana/dashboards/json/
# sglang-dashboard.json) queries, panel by panel: its eight panels, listed in docs/deploy.md.
SGLANG_DASHBOARD_PANELS = {
    "End-to-End Request Latency": ("e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
                                   "e2e_request_latency_seconds_count"),
    "End-to-End Request Latency(s) Heatmap": ("e2e_request_latency_seconds_bucket",),
    "Time-To-First-Token Latency": ("time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
                                    "time_to_first_token_seconds_count"),
    "Time-To-First-Token Seconds Heatmap": ("time_to_first_token_seconds_bucket",),
    "Num Running Requests": ("num_running_reqs",),
    "Token Generation Throughput (Tokens / S)": ("gen_throughput",),
    "Cache Hit Rate": ("cache_hit_rate",),
    "Number Queued Requests": ("num_queue_reqs",),
}


def test_sglang_dashboard_ported_by_a_prefix_swap_finds_every_series():
    from tests.unit.test_deploy_prometheus import exported_names

    exported = set()
    for role in ("prefill", "decode"):
        exported |= exported_names(Metrics(role, "m", "w").exposition().decode())
    for panel, names in SGLANG_DASHBOARD_PANELS.items():
        missing = [n for n in names if "pdmesh:" + n not in exported]
        assert not missing, f"SGLang's panel {panel!r} would find no {missing}"


def test_observe_many_records_what_as_many_observes_record():
    many, each = Metrics("router", "m", "r0"), Metrics("router", "m", "r0")
    for value, count in ((0.0035, 5), (0.0, 1), (0.25, 3), (1e9, 2), (0.01, 0)):
        observe_many(many.child(many.inter_token_latency), value, count)
        for _ in range(count):
            each.observe(each.inter_token_latency, value)

    def samples(m: Metrics) -> dict:
        return {(s.name, s.labels.get("le")): s.value
                for s in families(m)["pdmesh:router_inter_token_latency_seconds"].samples if not s.name.endswith("_created")}

    got, want = samples(many), samples(each)
    assert got.keys() == want.keys() and got[("pdmesh:router_inter_token_latency_seconds_count", None)] == 11
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-12 * max(1.0, abs(value)), key
