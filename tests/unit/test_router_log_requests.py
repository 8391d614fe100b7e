"""--log-requests (vLLM's --enable-log-requests / --disable-log-requests) on the real app with
scripted workers: on (the default), a request that completes, one refused and each attempt get
their info lines; off, none of those, while a failed request and its retry are still logged
and every request is still counted in the metrics."""

from __future__ import annotations

import grpc
import httpx
from structlog.testing import capture_logs

from services.fakes.workers import Behaviour
from tests.unit.test_router_app import MODEL, cluster_factory  # noqa: F401 - fixture

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


def traffic(c) -> list[str]:
    """One request served, one refused (400), one failed on prefill twice (503): the events logged."""
    with capture_logs() as logs:
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert httpx.post(c.url + "/v1/completions", json={**BODY, "max_tokens": -1}, timeout=10).status_code == 400
        c.prefills[0].behaviour = Behaviour(mode="fail", code=grpc.StatusCode.INTERNAL)
        c.decodes[0].behaviour = Behaviour(delay=5)  # it would wait for the KV that never comes
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 503
        c.all_rpcs_ended()
    return [e["event"] for e in logs]


def test_requests_are_logged_by_default(cluster_factory):  # noqa: F811
    events = traffic(cluster_factory())
    assert events.count("request done") == 1 and events.count("request rejected") == 1
    assert events.count("attempt") == 3 and events.count("request failed") == 1  # 1 served, 2 on the failing prefill


def test_off_only_the_routine_lines_go(cluster_factory):  # noqa: F811
    c = cluster_factory(log_requests=False)
    events = traffic(c)
    assert "request done" not in events and "request rejected" not in events
    assert events.count("attempt") == 1  # the retry after the failure, not the first attempts
    assert events.count("request failed") == 1 and events.count("attempt failed; failing over") == 2
    for status, count in (("200", 1), ("400", 1), ("503", 1)):
        assert c.metric("pdmesh:router_requests_total", status=status) == count
