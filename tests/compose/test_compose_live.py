"""pdmesh in containers: the README's compose bring-up (CPU override), for real.

One stack for the module (tests/compose/conftest.py builds the image, starts router + prefill +
decode and waits for their health checks; it always takes the stack down). In order:

1. a greedy chat completion through the router's published port equals the same request on a
   local (non-container) mesh started with the same deploy/pdmesh.env;
2. the host's Prometheus (Debian package) scrapes the three containers through
   deploy/prometheus/prometheus.yml, targets rewritten to the published ports;
3. the seed scenario in containers: decode is paused (`pause`: the container form of SIGSTOP)
   while it holds a room in its transfer queue; nothing more is sent; prefill's inflight gauge
   goes 1 -> 0 within the inflight deadline + watchdog interval, the client gets an error;
   after `unpause` the next request succeeds;
4. decode's process is killed: compose's `restart:` policy brings the container back, and the
   next request succeeds; prefill is not touched;
5. `down` leaves no container, network or volume.
After 1-4: every queue gauge 0 and every KV pool whole on both workers.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.compose.conftest import SETTINGS
from tests.integration.mesh import QUEUE_GAUGES, Mesh, in_background, wait_for
from tests.integration.mesh import scrape_metrics as metrics
from tests.integration.test_deploy_prometheus_live import Prometheus, config_for
from tests.unit.test_deploy_compose import ENV_FILE, need_tool, read_env_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

INFLIGHT_TIMEOUT = float(SETTINGS["TEST_INFLIGHT_TIMEOUT"])
INTERVAL = float(SETTINGS["TEST_WATCHDOG_INTERVAL"])
CHAT = {
    "model": "pdmesh-tiny",
    "messages": [{"role": "user", "content": "Hello! Tell me about containers."}],
    "max_tokens": 24,
    "temperature": 0,
}


def chat(router_url: str, body: dict = CHAT, timeout: float = 60) -> httpx.Response:
    return httpx.post(router_url + "/v1/chat/completions", json=body, timeout=timeout)


def assert_invariants(stack, timeout: float = 30) -> None:
    """Every queue gauge 0 and the KV pool whole, on both workers."""
    for role in ("prefill", "decode"):
        url = stack.url(role)

        def settled(role=role, url=url):
            m = metrics(url)
            h = httpx.get(url + "/health", timeout=5).json()
            nonzero = {g: m.get(g) for g in QUEUE_GAUGES[role] if m.get(g, 0) != 0}
            return not nonzero and h["kv_pages_free"] == h["kv_pages_total"] and h["kv_pool_ok"]

        wait_for(settled, timeout, f"{role} container: queue gauges 0 and KV pool whole", poll=0.2)


def router_sees_decode_healthy(stack) -> bool:
    h = httpx.get(stack.url("router") + "/health", timeout=5).json()
    return h["status"] == "ok" and all(w["healthy"] for w in h["decode"].values())


def test_1_chat_through_the_containers_equals_the_local_mesh(stack, tmp_path):
    router = stack.url("router")
    # the README's curl, on the published port
    r = httpx.post(
        router + "/v1/completions",
        json={"model": "pdmesh-tiny", "prompt": "Hello", "max_tokens": 16},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    # the curl samples (temperature 1, a random seed): the model may end the text before 16 tokens
    out = r.json()
    n, finish = out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
    assert 1 <= n <= 16 and finish in ("length", "stop") and (finish == "stop" or n == 16), out
    in_containers = chat(router)
    assert in_containers.status_code == 200, in_containers.text

    # the same request on a local mesh (processes on this host) with the same env file
    env = {k: v for k, v in read_env_file(ENV_FILE).items() if k.startswith("PDMESH_") and v}
    mesh = Mesh(tmp_path)
    try:
        p = mesh.start_prefill(env=env, wait=False)
        d = mesh.start_decode(env=env, wait=False)
        mesh.wait_healthy(p)
        mesh.wait_healthy(d)
        r = mesh.start_router([p], [d], env=env)
        local = chat(r.http_url)
        assert local.status_code == 200, local.text
    finally:
        mesh.close()

    a, b = in_containers.json(), local.json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["finish_reason"] == b["choices"][0]["finish_reason"]
    assert a["usage"] == b["usage"]
    assert a["usage"]["completion_tokens"] == CHAT["max_tokens"]
    print(f"containers and local mesh both answered {a['choices'][0]['message']['content']!r}")
    assert_invariants(stack)


def test_2_host_prometheus_scrapes_the_containers(stack, tmp_path):
    need_tool("prometheus", "prometheus")
    prom = Prometheus(
        tmp_path,
        config_for(
            {
                "pdmesh-router": stack.published("router", 8000),
                "pdmesh-prefill": stack.published("prefill", 8081),
                "pdmesh-decode": stack.published("decode", 8082),
            }
        ),
    )
    try:
        prom.wait_ready()
        wait_for(
            lambda: len([t for t in prom.api("targets")["activeTargets"] if t["health"] == "up"]) == 3,
            30,
            "prometheus to scrape router, prefill and decode",
            poll=0.25,
        )
        series = wait_for(
            lambda: prom.query('pdmesh:num_prefill_inflight_queue_reqs{job="pdmesh-prefill"}'),
            30,
            "prometheus to return prefill's inflight gauge",
            poll=0.25,
        )
        (s,) = series
        assert s["metric"]["engine_type"] == "prefill" and s["value"][1] == "0", s
        # the container's own worker id (its hostname is the container id)
        assert stack.container("prefill").startswith(s["metric"]["worker"].split("-")[1]), s["metric"]
        for job in ("pdmesh-decode", "pdmesh-router"):
            assert prom.query(f'up{{job="{job}"}} == 1'), job
    finally:
        prom.close()


def test_3_seed_scenario_paused_decode_container(stack):
    prefill, decode, router = stack.url("prefill"), stack.url("decode"), stack.url("router")
    inflight = "pdmesh:num_prefill_inflight_queue_reqs"
    evictions = "pdmesh:watchdog_evictions_total{queue=inflight}"
    evicted_before = metrics(prefill).get(evictions, 0)

    # one request; prefill's forward is delayed (TEST_DELAY_FORWARD), so its room waits in
    # decode's transfer queue: pause decode there. Nothing else is sent.
    thread, box = in_background(lambda: chat(router, timeout=120))
    wait_for(
        lambda: metrics(decode)["pdmesh:num_decode_transfer_queue_reqs"] == 1,
        30,
        "decode to hold the room in its transfer queue",
    )
    stack.pause("decode")
    paused = True
    try:
        assert metrics(prefill)[inflight] == 0, "the room reached inflight before decode was paused"
        wait_for(lambda: metrics(prefill)[inflight] == 1, 30, "prefill to send the KV (room inflight)")
        seen = time.monotonic()
        wait_for(
            lambda: metrics(prefill)[inflight] == 0,
            INFLIGHT_TIMEOUT + INTERVAL + 1.5,
            "prefill's watchdog to end the inflight room",
            poll=0.05,
        )
        print(f"inflight 1 -> 0 after {time.monotonic() - seen:.2f}s (deadline {INFLIGHT_TIMEOUT}s)")
        assert metrics(prefill)[evictions] == evicted_before + 1
        thread.join(timeout=90)
        assert "out" in box, "the client got no answer while decode is paused"
        assert box["out"].status_code >= 500, box["out"].text
        print(f"client: {box['out'].status_code} {box['out'].text[:200]}")
        stack.unpause("decode")
        paused = False
    finally:
        if paused:
            stack.unpause("decode")

    wait_for(lambda: router_sees_decode_healthy(stack), 60, "the router to see decode healthy again", poll=0.25)
    nxt = chat(router)
    assert nxt.status_code == 200, nxt.text
    assert_invariants(stack)


def test_4_killed_decode_container_is_restarted_and_serves(stack):
    before = {s: stack.inspect(s) for s in ("prefill", "decode")}
    stack.kill_service_process("decode")

    def restarted():
        st = stack.inspect("decode")
        return st["RestartCount"] > before["decode"]["RestartCount"] and st["State"]["Running"]

    wait_for(restarted, 60, "compose's restart policy to restart decode", poll=0.25)
    stack.wait_healthy(180, services=("decode",))
    wait_for(lambda: router_sees_decode_healthy(stack), 60, "the router to readmit decode", poll=0.25)
    r = chat(stack.url("router"))
    assert r.status_code == 200, r.text
    after = stack.inspect("prefill")
    assert after["State"]["Pid"] == before["prefill"]["State"]["Pid"], "prefill was restarted"
    assert after["RestartCount"] == before["prefill"]["RestartCount"]
    assert after["State"]["StartedAt"] == before["prefill"]["State"]["StartedAt"]
    assert_invariants(stack)


def test_5_down_leaves_nothing_behind(stack):
    out = stack.down()
    assert out.returncode == 0, out.stderr[-3000:]
    left = stack.leftovers()
    assert not left, f"left behind after down: {left}"
