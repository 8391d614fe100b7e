"""The launcher's pair probes (services/launch/probes.py) that the hosts soak's invariant 7 and
tests/hosts read: which pairs a router's /metrics marks, its passing canaries per pair, and the
requests each pair served according to the router's JSON log."""

from __future__ import annotations

import json

from services.launch.probes import attempts_by_room, canary_passes, marked_pairs, served_in_log

METRICS = """# TYPE pdmesh:router_pair_marked gauge
pdmesh:router_pair_marked{decode="d1:2",model_name="m",prefill="p1:1"} 1.0
pdmesh:router_pair_marked{decode="d2:2",model_name="m",prefill="p1:1"} 0.0
# TYPE pdmesh:canary_requests_total counter
pdmesh:canary_requests_total{decode="d1:2",model_name="m",prefill="p1:1",result="pass"} 3.0
pdmesh:canary_requests_total{decode="d1:2",model_name="m",prefill="p1:1",result="fail"} 4.0
pdmesh:canary_requests_total{decode="d2:2",model_name="m",prefill="p1:1",result="pass"} 2.0
"""


def line(event: str, **kw) -> str:
    return json.dumps({"event": event, "level": "info", **kw})


def test_marked_pairs_and_canary_passes_read_the_routers_metrics():
    assert marked_pairs(METRICS) == {("p1:1", "d1:2")}
    assert canary_passes(METRICS, "p1:1", "d1:2") == 3.0 and canary_passes(METRICS, "p2:1", "d1:2") == 0.0


def test_served_counts_attempts_with_no_failure_line_of_their_room():
    log = "\n".join([
        line("attempt", room=1, prefill="p1", decode="d1"),
        line("attempt failed; failing over", room=1, attempt=0),
        line("attempt", room=2, prefill="p1", decode="d2"),
        line("attempt", room=3, prefill="p2", decode="d1"),
        "not json",
        line("attempt", room=4, prefill="p2", decode="d1"),
        line("migrating request", room=4, reason="decode_ejected"),
        line("attempt", room=5, prefill="p1", decode="d2"),
        line("worker cannot hold the request; trying another", room=5),
        line("attempt", room=6, prefill="p1", decode="d2"),
    ])
    assert served_in_log(log) == {("p1", "d2"): 2, ("p2", "d1"): 1}
    assert served_in_log(log, rooms={2, 3}) == {("p1", "d2"): 1, ("p2", "d1"): 1}
    assert set(attempts_by_room(log)) == {1, 2, 3, 4, 5, 6}
