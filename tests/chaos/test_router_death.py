"""Router killed mid-stream: its RPCs are cancelled by the connection loss, and the workers
abort the rooms (DESIGN.md §4, "router restart")."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.integration.mesh import wait_for

pytestmark = pytest.mark.integration


def test_workers_abort_rooms_of_a_dead_router(mesh):
    (p,), (d,) = mesh.start_workers(1, 1)
    router = mesh.start_router([p], [d])
    body = {"model": "pdmesh-tiny", "prompt": "a long one", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", router.http_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: dropping the iterator closes the response
        seen = 0
        while seen < 3:
            line = next(lines)
            if line.startswith("data: {"):
                json.loads(line[6:])
                seen += 1
        assert d.metrics()["pdmesh:num_running_reqs"] == 1
        router.kill()  # SIGKILL: no goodbye, only closed connections
    wait_for(lambda: d.metrics()["pdmesh:num_running_reqs"] == 0, 10, "decode to abort the orphaned room")
    assert d.metrics()["pdmesh:num_aborted_requests_total"] == 1
    mesh.assert_invariants()
