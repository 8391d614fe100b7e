"""Is a service up, and has it settled: waits on a condition with a deadline, HTTP /health and
the standard gRPC health service, Prometheus scrapes, and the queue gauges that read 0 on an
idle worker."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

# Gauges each worker role holds at 0 once no request is in flight.
QUEUE_GAUGES = {
    "prefill": (
        "pdmesh:num_prefill_prealloc_queue_reqs",
        "pdmesh:num_prefill_inflight_queue_reqs",
        "pdmesh:num_queue_reqs",
        "pdmesh:num_running_reqs",
    ),
    "decode": (
        "pdmesh:num_decode_prealloc_queue_reqs",
        "pdmesh:num_decode_transfer_queue_reqs",
        "pdmesh:num_running_reqs",
        "pdmesh:num_retracted_reqs",
    ),
}


def wait_for(cond: Callable[[], object], timeout: float, what: str, poll: float = 0.02):
    """Wait until cond() is truthy (returns it); fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except AssertionError:
            raise  # the condition itself decided the wait is hopeless (e.g. the process died)
        except Exception as e:  # noqa: BLE001 - the condition may fail until the service is up
            last_exc = e
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def http_healthy(url: str, timeout: float = 2) -> bool:
    """GET url/health answers 200."""
    try:
        return httpx.get(url + "/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def grpc_serving(addr: str, service: str = "", timeout: float = 2) -> bool:
    """The standard grpc.health.v1 service at addr reports SERVING for `service` ("" = the
    server as a whole). The health service needs no internal token."""
    with grpc.insecure_channel(addr) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def scrape_metrics(base_url: str, keep_queue: bool = True, verify: bool = True) -> dict[str, float]:
    """Samples of base_url/metrics by name, summed over labels (one worker per process); with
    keep_queue, a sample labelled `queue` keeps it in its key: `name{queue=q}`. `verify`: False
    for an HTTPS service the caller started itself."""
    text = httpx.get(base_url + "/metrics", timeout=5, verify=verify).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            queue = s.labels.get("queue") if keep_queue else None
            key = f"{s.name}{{queue={queue}}}" if queue else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def labelled_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` in a Prometheus text exposition."""
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def attempts_in_log(log_text: str) -> list[tuple[str, str]]:
    """(prefill, decode) of every attempt a router's JSON log records, in order."""
    pairs = []
    for line in log_text.splitlines():
        if '"attempt"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "attempt":
            pairs.append((event["prefill"], event["decode"]))
    return pairs


# The router's log lines that end an attempt without its answer (services/router/orchestrator.py)
ATTEMPT_FAILED = ("attempt failed", "attempt failed; failing over", "worker cannot hold the request; trying another",
                  "migrating request")


def _attempt_events(log_text: str):
    for line in log_text.splitlines():
        if '"attempt' not in line and '"migrating' not in line and '"worker cannot' not in line:
            continue
        try:
            yield json.loads(line)
        except ValueError:
            continue


def attempts_by_room(log_text: str) -> dict[object, tuple[str, str]]:
    """room -> (prefill, decode) of every attempt in a router's JSON log (each attempt has a
    room of its own)."""
    return {e.get("room"): (e["prefill"], e["decode"]) for e in _attempt_events(log_text)
            if e.get("event") == "attempt"}


def served_in_log(log_text: str, rooms: set | None = None) -> dict[tuple[str, str], int]:
    """Attempts per (prefill, decode) in a router's JSON log (of `rooms` only, when given) that no
    failure line of the same room followed: the requests each pair served."""
    failed = {e.get("room") for e in _attempt_events(log_text) if e.get("event") in ATTEMPT_FAILED}
    served: dict[tuple[str, str], int] = {}
    for room, pair in attempts_by_room(log_text).items():
        if room not in failed and (rooms is None or room in rooms):
            served[pair] = served.get(pair, 0) + 1
    return served


def marked_pairs(metrics_text: str) -> set[tuple[str, str]]:
    """The (prefill, decode) pairs a router's /metrics says it avoids (`router_pair_marked` 1)."""
    return {(lb["prefill"], lb["decode"]) for lb, v in labelled_samples(metrics_text, "pdmesh:router_pair_marked")
            if v}


def canary_passes(metrics_text: str, prefill: str, decode: str) -> float:
    """Passing canaries a router's /metrics counts on the pair (prefill, decode) (gRPC addresses)."""
    return sum(v for lb, v in labelled_samples(metrics_text, "pdmesh:canary_requests_total")
               if (lb["prefill"], lb["decode"], lb["result"]) == (prefill, decode, "pass"))


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, T stopped, Z exited but not reaped, ...);
    None once it is gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
