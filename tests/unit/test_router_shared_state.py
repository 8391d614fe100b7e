"""What the router's processes share (--processes): admission, per-worker load and ejections, and
one /metrics. Two views of one state file stand for two processes; the pools talk to real
(fake) gRPC workers."""

from __future__ import annotations

import asyncio
import fcntl
import multiprocessing
import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import Metrics
from services.fakes.workers import FakeDecode, FakePrefill
from services.router.load_view import SharedLoad
from services.router.pool import WorkerPool, load_of
from services.router.shared_state import ADMIT_LOCK_WAIT, MAX_WORKERS, SharedState, state_path, worker_key
from services.router.sibling_metrics import SIBLING_TIMEOUT, SiblingMetrics, merge_expositions, socket_path

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def two(tmp_path):
    path = state_path(str(tmp_path))
    SharedState.create(path, 2)
    a, b = SharedState(path, 2, 0), SharedState(path, 2, 1)
    a.claim()
    b.claim()
    yield a, b
    a.close()
    b.close()


def test_admission_counts_every_process(two):
    a, b = two
    assert a.try_admit(3) and a.try_admit(3) and b.try_admit(3)
    assert not a.try_admit(3) and not b.try_admit(3)  # 3 admitted between them
    assert a.peers_active() == 1 and b.peers_active() == 2
    a.set_active(1)  # one of a's requests finished
    assert b.try_admit(3) and not a.try_admit(3)


def test_admission_takes_a_requests_choices_at_once(two):
    a, b = two
    assert a.try_admit(8, cost=5)
    assert not b.try_admit(8, cost=4)  # 5 + 4 > 8: nothing is taken
    assert b.peers_active() == 5 and a.peers_active() == 0
    assert b.try_admit(8, cost=3) and not a.try_admit(8)
    a.set_active(0)  # a's request of 5 choices finished
    assert a.try_admit(8, cost=5) and not b.try_admit(8, cost=1)


def test_a_cleared_row_stops_counting(two):
    a, b = two
    assert a.try_admit(2) and a.try_admit(2)
    a.publish(worker_key("decode", "x:1"), inflight=5, ejections=1)
    assert not b.try_admit(2) and b.peers()[worker_key("decode", "x:1")].inflight == 5
    b.clear_row(0)  # the supervisor, after process 0 died
    assert b.try_admit(2) and b.peers() == {}


def test_peers_sum_per_worker_and_leave_out_our_own_row(tmp_path):
    path = state_path(str(tmp_path))
    SharedState.create(path, 3)
    views = [SharedState(path, 3, i) for i in range(3)]
    k1, k2 = worker_key("prefill", "h:1"), worker_key("decode", "h:1")
    assert k1 != k2 and k1 > 0
    views[0].publish(k1, 2, 0)
    views[1].publish(k1, 3, 1)
    views[1].publish(k2, 1, 0)
    views[2].publish(k1, 100, 7)  # our own: never in our view of the peers
    peers = views[2].peers()
    assert (peers[k1].inflight, peers[k1].ejections, peers[k2].inflight) == (5, 1, 1)
    views[1].publish(k1, 0, 1)  # updates its entry in place
    assert views[2].peers()[k1].inflight == 2
    for v in views:
        v.close()


def test_a_holder_frozen_with_the_lock_does_not_stop_admission(two):
    a, _ = two
    holder = os.open(a.path, os.O_RDWR)  # another process, frozen mid-admission
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert a.try_admit(2) and a.try_admit(2) and not a.try_admit(2)  # the count still bounds it
        assert time.monotonic() - t0 < 3 * ADMIT_LOCK_WAIT + 1.0  # not held up by the frozen holder
    finally:
        os.close(holder)
    assert a.try_admit(3)  # the lock is free again


def test_heartbeats(two):
    a, b = two
    assert b.heartbeat_age(0) is None  # not beating yet: the supervisor leaves it be
    a.beat()
    assert 0 <= b.heartbeat_age(0) < 0.5
    b.clear_row(0)
    assert b.heartbeat_age(0) is None


def test_a_full_row_refuses_more_workers(two):
    a, _ = two
    assert all(a.publish(worker_key("decode", f"h:{i}"), 0, 0) for i in range(MAX_WORKERS))
    assert not a.publish(worker_key("decode", "one:more"), 0, 0)
    assert a.publish(worker_key("decode", "h:0"), 1, 0)  # known ones still update


def _admit_many(path: str, index: int, limit: int, tries: int, out) -> None:
    view = SharedState(path, 2, index)
    out.put(sum(view.try_admit(limit) for _ in range(tries)))


def test_processes_admitting_at_once_never_pass_the_limit(tmp_path):
    path = state_path(str(tmp_path))
    SharedState.create(path, 2)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_admit_many, args=(path, i, 5000, 20000, out)) for i in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(10)
    assert sum(got) == 5000, got


# --- the pools of two processes --------------------------------------------------------------------


async def _pools(tmp_path, prefill: FakePrefill, decode: FakeDecode):
    path = state_path(str(tmp_path))
    SharedState.create(path, 2)
    pools = [
        WorkerPool([prefill.addr], [decode.addr], interval=30, timeout=0.5, failure_threshold=3,
                   load=SharedLoad(SharedState(path, 2, i)))
        for i in range(2)
    ]
    for pool in pools:
        await pool.refresh_addresses()
        await pool.probe_all()
    return pools


def test_each_process_sees_the_others_load_and_ejections(tmp_path):
    asyncio.run(_each_process_sees_the_others_load_and_ejections(tmp_path))


async def _each_process_sees_the_others_load_and_ejections(tmp_path):
    prefill, decode = FakePrefill(), FakeDecode()
    await prefill.start()
    await decode.start()
    a, b = await _pools(tmp_path, prefill, decode)
    try:
        assert all(w.healthy for w in (*a.workers, *b.workers))
        first, second = await a.choose_pair(), await a.choose_pair()
        a.share()
        b.share()
        bd = b.decodes[0]
        assert (bd.inflight, bd.peer_inflight, load_of(bd)) == (0, 2, 2)
        first.release()
        second.release()
        a.share()
        b.share()
        assert load_of(bd) == 0

        # a ejects the decode (it stopped serving); b, whose own probes are 30 s apart, probes it at
        # its next exchange and ejects it too instead of sending it requests meanwhile
        decode.set_serving(False)
        a._mark(a.decodes[0], False, "test: probe failed")
        a.share()
        b.share()
        for _ in range(100):
            if not bd.healthy:
                break
            await asyncio.sleep(0.02)
        assert not bd.healthy
        # a worker that a peer ejected but that answers our probe stays in our rotation
        a._mark(a.prefills[0], False, "test: spurious")
        a.share()
        b.share()
        await asyncio.sleep(0.2)
        assert b.prefills[0].healthy
    finally:
        for pool in (a, b):
            await pool.close()
        await prefill.stop()
        await decode.stop()


# --- one /metrics --------------------------------------------------------------------------------


def _metrics(label: str, requests: int) -> Metrics:
    m = Metrics("router", "pdmesh-tiny", label)
    m.gauge_from("num_running_reqs", lambda: 1)
    m.inc(m.num_requests, requests)
    m.observe(m.e2e_request_latency, 0.01)
    return m


def test_merged_expositions_parse_and_keep_every_series():
    a, b = _metrics("router-h-1-p0", 3), _metrics("router-h-1-p1", 4)
    merged = merge_expositions([a.exposition(), b.exposition()]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}  # raises on a malformed text
    requests = families["pdmesh:router_num_requests"]
    assert sorted((s.labels["worker"], s.value) for s in requests.samples if s.name.endswith("_total")) == [
        ("router-h-1-p0", 3.0), ("router-h-1-p1", 4.0)]
    assert sum(s.value for s in families["pdmesh:router_num_running_reqs"].samples) == 2
    count = [s for s in families["pdmesh:router_e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert len(count) == 2
    assert merged.count("# TYPE pdmesh:router_num_requests_total counter") == 1
    assert merge_expositions([a.exposition()]).decode().count("\n") == a.exposition().decode().count("\n")


def test_sibling_metrics_gather_over_the_shared_folder(tmp_path):
    asyncio.run(_sibling_metrics_gather(tmp_path))


async def _sibling_metrics_gather(tmp_path):
    ms = [_metrics(f"router-h-1-p{i}", i + 1) for i in range(3)]
    sibs = [SiblingMetrics(str(tmp_path), 3, i, ms[i].exposition) for i in range(3)]
    for s in sibs[:2]:
        await s.start()  # the third process is down: left out, not a failed scrape
    try:
        text = (await sibs[0].exposition()).decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        workers = {s.labels["worker"] for s in families["pdmesh:router_num_requests"].samples}
        assert workers == {"router-h-1-p0", "router-h-1-p1"}
        assert families["pdmesh:router_processes_scraped"].samples[0].value == 2
        assert families["pdmesh:router_processes"].samples[0].value == 3
    finally:
        for s in sibs[:2]:
            await s.close()


def test_a_sibling_that_never_answers_is_left_out_in_bounded_time(tmp_path):
    asyncio.run(_silent_sibling(tmp_path))


async def _silent_sibling(tmp_path):
    async def never_answer(reader, writer):
        await asyncio.sleep(30)

    silent = await asyncio.start_unix_server(never_answer, path=socket_path(str(tmp_path), 1))
    own = SiblingMetrics(str(tmp_path), 2, 0, _metrics("router-h-1-p0", 1).exposition)
    try:
        t0 = time.monotonic()
        text = (await own.exposition()).decode()
        assert time.monotonic() - t0 < SIBLING_TIMEOUT + 1
        assert "pdmesh:router_processes_scraped 1" in text and 'worker="router-h-1-p0"' in text
    finally:
        silent.close()


def test_worker_keys_are_stable_and_distinct():
    assert worker_key("decode", "10.0.0.1:50051") == worker_key("decode", "10.0.0.1:50051")
    assert len({worker_key(r, f"h:{i}") for r in ("prefill", "decode") for i in range(1000)}) == 2000

