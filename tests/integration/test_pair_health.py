"""Health per (prefill, decode) pair and the canary, against real processes (gRPC, NIXL).

2 prefills + 2 decodes, where prefill #0 refuses the attach of decode #0 only
(`fail_attach_from`): both workers answer their health checks, but that one pair cannot move KV.

- Idle: the router's canary (a one-token request through the real path) marks exactly
  (P0, D0) within one canary interval + timeout and passes on the other three pairs; the
  canaries never show in the workers' request metrics.
- Under load: no request fails, none is routed to (P0, D0) after the mark, and P0 and D0 keep
  serving through their other peers.
- Restarting P0 without the fault (a new epoch) forgets its marks; the next canary passes.

Each scenario ends with the mesh's invariants: queue gauges 0, KV pools whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.mesh import Mesh, attempts_in_log, labelled_samples, scrape_metrics, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CANARY_INTERVAL, CANARY_TIMEOUT = 1.0, 5.0
PREFILL_FLAGS = ("--watchdog-interval", "0.5", "--bootstrap-timeout", "4", "--inflight-timeout", "3")
DECODE_FLAGS = ("--watchdog-interval", "0.5", "--heartbeat-interval", "0.5", "--transfer-timeout", "3",
                "--prealloc-timeout", "4")


def marked_pairs(router) -> set[tuple[str, str]]:
    text = httpx.get(router.http_url + "/metrics", timeout=5).text
    return {(lb["prefill"], lb["decode"]) for lb, v in labelled_samples(text, "pdmesh:router_pair_marked") if v}


def canary_counts(router) -> dict[tuple[str, str, str], float]:
    text = httpx.get(router.http_url + "/metrics", timeout=5).text
    return {(lb["prefill"], lb["decode"], lb["result"]): v
            for lb, v in labelled_samples(text, "pdmesh:canary_requests_total")}


@pytest.fixture(scope="module")
def broken_pair(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("pair-health"))
    try:
        ds = [m.start_decode(*DECODE_FLAGS, wait=False) for _ in range(2)]
        p_bad = m.start_prefill(*PREFILL_FLAGS, "--faults", f"fail_attach_from=-{ds[0].grpc_port}",
                                wait=False)
        p_ok = m.start_prefill(*PREFILL_FLAGS, wait=False)
        for w in (*ds, p_bad, p_ok):
            m.wait_healthy(w)
        r = m.start_router([p_bad, p_ok], ds, "--canary-interval", str(CANARY_INTERVAL), "--canary-timeout",
                           str(CANARY_TIMEOUT), "--pair-hold", "0", "--health-check-interval", "0.5",
                           "--request-timeout", "60", "--local-prefill-max-tokens", "0")  # every request via a pair
        yield m, (p_bad, p_ok), ds, r
    finally:
        m.close()


def test_the_canary_marks_exactly_the_broken_pair_while_idle(broken_pair):
    m, (p_bad, p_ok), (d_bad, d_ok), r = broken_pair
    bad = (p_bad.grpc_addr, d_bad.grpc_addr)
    # one interval to become due, then at most the canary's own timeout (plus a probe's slack)
    wait_for(lambda: marked_pairs(r) == {bad}, CANARY_INTERVAL * 2 + CANARY_TIMEOUT + 10, "exactly P0-D0 marked")

    def others_passed():
        counts = canary_counts(r)
        return all(counts.get((p.grpc_addr, d.grpc_addr, "pass"), 0) >= 1
                   for p, d in ((p_bad, d_ok), (p_ok, d_bad), (p_ok, d_ok)))

    wait_for(others_passed, CANARY_INTERVAL * 2 + CANARY_TIMEOUT + 10, "a passing canary on each other pair")
    assert canary_counts(r).get((*bad, "pass"), 0) == 0
    health = httpx.get(r.http_url + "/health", timeout=5).json()
    assert health["status"] == "ok"
    assert [(x["prefill"], x["decode"]) for x in health["marked_pairs"]] == [bad]
    # the canaries ran on every worker, yet none counts as a request there, nor at the router
    for w in (p_bad, p_ok, d_bad, d_ok):
        assert w.metrics().get("pdmesh:num_requests_total", 0) == 0, w.role
    assert not any(k.startswith("pdmesh:router_requests_total") for k, v in r.metrics().items() if v)
    m.assert_invariants()
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "no admission slot held")


def test_requests_avoid_the_marked_pair_and_both_workers_keep_serving(broken_pair):
    m, (p_bad, p_ok), (d_bad, d_ok), r = broken_pair
    bad = (p_bad.grpc_addr, d_bad.grpc_addr)
    wait_for(lambda: bad in marked_pairs(r), CANARY_INTERVAL * 2 + CANARY_TIMEOUT + 10, "P0-D0 marked")
    already = len(attempts_in_log(r.log()))

    def one(i: int) -> int:
        return httpx.post(r.http_url + "/v1/completions", timeout=70, json={
            "model": "pdmesh-tiny", "prompt": f"pair {i}", "max_tokens": 4, "temperature": 0}).status_code

    # the policy picks the least-loaded decode, and each worker's load includes what the canaries
    # hold there: a batch may happen to use one decode only, so batches go on (a bounded number)
    # until both cross pairs have served
    crossed = {(p_bad.grpc_addr, d_ok.grpc_addr), (p_ok.grpc_addr, d_bad.grpc_addr)}
    sent = 0
    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            codes = list(pool.map(one, range(sent, sent + 24)))
            sent += 24
            assert codes == [200] * 24
            pairs = attempts_in_log(r.log())[already:]
            assert len(pairs) == sent and bad not in pairs, pairs  # no attempt was sent to the marked pair
            if crossed <= set(pairs):
                break
    assert crossed <= set(pairs), pairs
    for w in (p_bad, d_bad):  # each still served through its other peer
        assert w.metrics().get("pdmesh:num_requests_total", 0) > 0, w.role
    m.assert_invariants()
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "no admission slot held")

@pytest.mark.long

def test_a_restarted_prefill_starts_with_clean_pairs(broken_pair):
    m, (p_bad, p_ok), (d_bad, d_ok), r = broken_pair
    bad = (p_bad.grpc_addr, d_bad.grpc_addr)
    wait_for(lambda: bad in marked_pairs(r), CANARY_INTERVAL * 2 + CANARY_TIMEOUT + 10, "P0-D0 marked")
    passes = canary_counts(r).get((*bad, "pass"), 0)
    fixed = m.restart(p_bad, drop_flags=("--faults",))
    wait_for(lambda: canary_counts(r).get((*bad, "pass"), 0) > passes,
             CANARY_INTERVAL * 4 + CANARY_TIMEOUT + 15, "a passing canary on the repaired pair")
    assert bad not in marked_pairs(r)
    assert fixed.grpc_addr == bad[0]
    assert scrape_metrics(r.http_url).get("pdmesh:router_pair_marked", 0) == 0
    m.assert_invariants()
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "no admission slot held")
