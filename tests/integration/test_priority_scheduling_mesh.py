"""vLLM's priority scheduling through router + prefill + decode processes.

The router runs with `--scheduling-policy priority`; decode takes one request per step
(`--max-running-requests 1`), so the order in which it serves the requests it holds shows in
the order they finish. A long request runs first; two more arrive while it runs, the later one
with a lower `priority` value. Decode serves the lowest value first — even ahead of the request
already running, which waits with its KV kept, as vLLM's priority scheduler lets a request
overtake — then the rest by arrival: the urgent one finishes first, the long one, that arrived
first, before the other. A second router on the same workers with the default fcfs policy
refuses a non-zero priority (400 naming it), as vLLM does. Afterwards the invariants hold.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.mesh import mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "pdmesh-tiny"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("priority"), decode_flags=("--max-running-requests", "1"),
                          router_flags=("--scheduling-policy", "priority")) as (m, ps, ds, r):
        yield m, ps, ds, r


def _complete(url: str, body: dict, done: list, name: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, "ignore_eos": True, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    done.append((name, time.monotonic(), r.json()["usage"]["completion_tokens"]))


def test_a_lower_priority_value_is_served_first(mesh):
    m, _, _, r = mesh
    done: list = []
    # the long request runs first: its stream's first token says decode holds it
    long_started = threading.Event()

    def long_request():
        with httpx.stream("POST", r.http_url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "The long one", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and not long_started.is_set():
                    long_started.set()
        done.append(("long", time.monotonic(), 400))

    threads = [threading.Thread(target=long_request)]
    threads[0].start()
    assert long_started.wait(60)
    for name, priority in (("normal", 0), ("urgent", -1)):
        t = threading.Thread(target=_complete, args=(r.http_url, {"prompt": f"The {name} one", "max_tokens": 30,
                                                                   "priority": priority}, done, name))
        t.start()
        threads.append(t)
        time.sleep(0.05)  # in this order
    for t in threads:
        t.join(150)
    order = [name for name, _, _ in sorted(done, key=lambda d: d[1])]
    assert order == ["urgent", "long", "normal"], done
    m.assert_invariants()


def test_fcfs_router_refuses_a_priority(mesh):
    m, ps, ds, _ = mesh
    fcfs = m.start_router(ps, ds)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    r = httpx.post(fcfs.http_url + "/v1/completions", json={**body, "priority": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert httpx.post(fcfs.http_url + "/v1/completions", json={**body, "priority": 0}, timeout=30).status_code == 200
    m.assert_invariants()
