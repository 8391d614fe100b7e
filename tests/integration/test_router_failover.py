"""Fail-over before the first byte, against real processes (real gRPC, real NIXL).

- 1 prefill + 2 decodes, decode #0 SIGSTOPped just before the requests: 6 sequential requests
  all return 200, each within the health detection time + 2 s (a request that landed on the
  frozen decode moves to the other one the moment the pool ejects it).
- 1 prefill + 1 decode (a second router in front of the same workers), the decode frozen: 503
  `no_healthy_workers` within the detection time + 2 s; after SIGCONT the next request succeeds.
- 2 prefills + 2 decodes under steady load, one SIGKILL of each role and one SIGSTOP longer
  than the workers' deadlines: no request fails, and every greedy success equals the
  single-process output.

Each scenario ends with the mesh's invariants: queue gauges 0, KV pools whole.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from tests.integration.mesh import Mesh, mesh_with_router, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
TOK = load_tokenizer(None)  # the default model's: models/pdmesh-tiny
PREFILL_FLAGS = ("--inflight-timeout", "2", "--watchdog-interval", "0.5", "--bootstrap-timeout", "4")
DECODE_FLAGS = ("--watchdog-interval", "0.5", "--heartbeat-interval", "0.5", "--transfer-timeout", "3",
                "--prealloc-timeout", "4")
INTERVAL, PROBE_TIMEOUT, THRESHOLD = 0.5, 0.5, 2
# Worst case from a freeze to the ejection: the next probe starts within one interval, and
# THRESHOLD probes in a row each time out.
DETECTION = INTERVAL + THRESHOLD * (INTERVAL + PROBE_TIMEOUT)
ROUTER_FLAGS = ("--health-check-interval", str(INTERVAL), "--health-check-timeout", str(PROBE_TIMEOUT),
                "--health-failure-threshold", str(THRESHOLD), "--request-timeout", "60",
                "--stream-stall-timeout", "3",
                "--local-prefill-max-tokens", "0")  # every request through prefill: these tests fault it


def complete(url: str, prompt: str, max_tokens: int = 8, stream: bool = False, timeout: float = 70) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": stream})


def healthy(r, role: str, proc) -> bool:
    return httpx.get(r.http_url + "/health", timeout=5).json()[role][proc.grpc_addr]["healthy"]


@pytest.fixture(scope="module")
def one_p_two_d(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("router-failover"), 1, 2, PREFILL_FLAGS, DECODE_FLAGS,
                          ROUTER_FLAGS) as (m, (p,), ds, r):
        yield m, p, ds, r


def test_frozen_decode_costs_the_client_nothing(one_p_two_d):
    m, p, ds, r = one_p_two_d
    d0 = ds[0]
    d0.stop()  # SIGSTOP, just before the requests: the router does not know yet
    try:
        for n in range(6):
            t0 = time.monotonic()
            resp = complete(r.http_url, f"request {n}: hello")
            elapsed = time.monotonic() - t0
            assert resp.status_code == 200, (n, resp.text)
            assert elapsed <= DETECTION + 2.0, (n, elapsed)
        assert not healthy(r, "decode", d0)
    finally:
        d0.cont()
    wait_for(lambda: healthy(r, "decode", d0), 10, "the thawed decode to be re-admitted")
    m.assert_invariants(timeout=20)


def test_only_decode_frozen_is_503_at_once_then_serves_after_sigcont(one_p_two_d):
    m, p, ds, _ = one_p_two_d
    d0 = ds[0]
    r1 = m.start_router([p], [d0], *ROUTER_FLAGS)  # the same workers, a router that knows one decode
    try:
        assert complete(r1.http_url, "warm up").status_code == 200
        d0.stop()
        try:
            t0 = time.monotonic()
            resp = complete(r1.http_url, "while frozen")
            elapsed = time.monotonic() - t0
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_workers", resp.text
            assert elapsed <= DETECTION + 2.0, elapsed
        finally:
            d0.cont()
        resp = complete(r1.http_url, "after the thaw")
        assert resp.status_code == 200, resp.text
        m.assert_invariants(timeout=20)
    finally:
        r1.kill()


# --- the stall rule: waiting is not silence ----------------------------------------------------------------


def test_long_prefill_is_not_a_stall_keepalives_bridge_it(tmp_path):
    """Prefill's forward takes 3 s, the router's stall timeout is 1 s: decode holds the room in its
    transfer queue and sends keep-alive chunks, so the request is neither failed over nor failed."""
    m = Mesh(tmp_path)
    try:
        p = m.start_prefill(*PREFILL_FLAGS, "--faults", "delay_forward=3", wait=False)
        d = m.start_decode(*DECODE_FLAGS, "--keepalive-interval", "0.2", wait=False)
        m.wait_healthy(p)
        m.wait_healthy(d)
        r = m.start_router([p], [d], "--health-check-interval", "0.5", "--health-check-timeout", "0.5",
                           "--stream-stall-timeout", "1", "--request-timeout", "30", "--local-prefill-max-tokens", "0")
        t0 = time.monotonic()
        resp = complete(r.http_url, "a slow prompt", stream=True)
        assert resp.status_code == 200 and 'data: {"error"' not in resp.text, resp.text[-500:]
        assert time.monotonic() - t0 >= 3.0  # it really waited for the slow forward
        log = r.log()
        assert log.count('"event": "attempt"') == 1 and "failing over" not in log, log[-2000:]
        m.assert_invariants()
    finally:
        m.close()


# --- 2P + 2D under load: kill one of each, freeze one past the deadlines --------------------------------


def reference(prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Greedy single-process output for each prompt (services/engine/local_generate.py)."""
    from services.engine.kv_pool import KVPool
    from services.engine.loader import load_model
    from services.engine.local_generate import generate_full as generate

    model = load_model(None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [TOK.encode(p) for p in prompts]
    out = generate(model.model, KVPool(model.config, 256, 16), ids, [params] * len(ids))
    return {p: TOK.decode(g.token_ids) for p, g in zip(prompts, out, strict=True)}


@pytest.mark.long  # make test's short form: test_router_mesh.py's 2P+2D kill of one of each under load
def test_two_by_two_kill_and_freeze_under_load_loses_nothing(tmp_path):
    m = Mesh(tmp_path)
    try:
        _soak(m)
    finally:
        m.close()


def _soak(m: Mesh) -> None:
    max_tokens = 24
    prompts = [f"client {i} asks question {k}" for i in range(4) for k in range(4)]
    expected = reference(prompts, max_tokens)
    ps = [m.start_prefill(*PREFILL_FLAGS, wait=False) for _ in range(2)]
    ds = [m.start_decode(*DECODE_FLAGS, wait=False) for _ in range(2)]
    for w in (*ps, *ds):
        m.wait_healthy(w)
    r = m.start_router(ps, ds, *ROUTER_FLAGS)

    lock = threading.Lock()
    results: list[tuple[str, bool, str]] = []  # (prompt, ok, text or error)
    stop = threading.Event()

    def client_loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = prompts[i * 4 + n % 4]
            stream = (n + i) % 2 == 0
            n += 1
            try:
                resp = complete(r.http_url, prompt, max_tokens, stream=stream)
                if resp.status_code != 200:
                    ok, text = False, f"{resp.status_code} {resp.text[-400:]}"
                elif stream:
                    ok = 'data: {"error"' not in resp.text and resp.text.endswith("data: [DONE]\n\n")
                    text = sse_text(resp.text) if ok else resp.text[-400:]
                else:
                    ok, text = True, resp.json()["choices"][0]["text"]
            except httpx.HTTPError as e:
                ok, text = False, repr(e)
            with lock:
                results.append((prompt, ok, text))

    def done() -> int:
        with lock:
            return len(results)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: done() >= 8, 60, "load to flow")
        ps[0] = m.restart(ps[0], wait=False)  # SIGKILL prefill #0 under load, then start it again
        base = done()
        wait_for(lambda: done() >= base + 8, 60, "requests to flow after the prefill kill")
        m.wait_healthy(ps[0])
        ds[0] = m.restart(ds[0], wait=False)  # SIGKILL decode #0
        base = done()
        wait_for(lambda: done() >= base + 8, 60, "requests to flow after the decode kill")
        m.wait_healthy(ds[0])
        wait_for(lambda: healthy(r, "decode", ds[0]) and healthy(r, "prefill", ps[0]), 20, "both restarted re-admitted")
        ds[1].stop()  # SIGSTOP decode #1 for longer than the workers' deadlines (inflight 2 s, bootstrap 4 s)
        try:
            base = done()
            time.sleep(6.0)  # the freeze itself is the scenario: it must outlast the deadlines
            wait_for(lambda: done() >= base + 8, 60, "requests to flow while decode #1 is frozen")
        finally:
            ds[1].cont()
        wait_for(lambda: healthy(r, "decode", ds[1]), 20, "the thawed decode re-admitted")
        base = done()
        wait_for(lambda: done() >= base + 8, 60, "requests to flow after the thaw")
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads)
    failed = [(p, text) for p, ok, text in results if not ok]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    wrong = [(p, text, expected[p]) for p, _, text in results if text != expected[p]]
    assert not wrong, f"{len(wrong)} of {len(results)} differ from single-process output: {wrong[:2]}"
    log = r.log()
    assert "failing over" in log or "migrating request" in log, "the faults never reached a request"
    m.assert_invariants(timeout=20)


def sse_text(raw: str) -> str:
    import json

    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e and not e.startswith(":")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
