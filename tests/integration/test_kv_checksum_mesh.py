"""The KV checksum through real processes: 2 prefills + 2 decodes under load, real NIXL.

Decode #0 corrupts what lands in half of its rooms (`corrupt_kv=0.5`: a page negated after the
WRITE) and prefill #0 misroutes half of its rooms' pages (`misroute_kv=0.5`: two pages swapped
into each other's destination). With the checksum on, every request succeeds and equals the
single-process output (greedy and seeded): each bad room fails on decode before its first step
(DATA_LOSS) and the router fails over; decode's `kv_integrity_failures_total` counts every
fault that struck. The control run (`--kv-checksum off` everywhere) shows that the same faults
do produce wrong outputs with a 200. Each run ends with the mesh's invariants.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from tests.integration.mesh import Mesh, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

TOK = load_tokenizer(None)
MAX_TOKENS = 12
# distinct prompts of 3+ pages (16 tokens each), so a misroute always has two pages to swap
PROMPTS = [f"Request {i}: " + " ".join(f"word{(i * 7 + k) % 50}" for k in range(40)) for i in range(24)]
SEEDS = {p: (None if i % 2 == 0 else 1000 + i) for i, p in enumerate(PROMPTS)}
WORKER_FLAGS = ("--watchdog-interval", "0.5")
# every request through prefill and a KV transfer (no conditional disaggregation): the checksum is what is tested
ROUTER_FLAGS = ("--request-timeout", "60", "--health-check-interval", "0.5", "--local-prefill-max-tokens", "0")


def params_of(prompt: str) -> SamplingParams:
    seed = SEEDS[prompt]
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    from services.engine.kv_pool import KVPool
    from services.engine.loader import load_model
    from services.engine.local_generate import generate_full

    model = load_model(None)
    out = generate_full(model.model, KVPool(model.config, 512, 16), [TOK.encode(p) for p in PROMPTS],
                        [params_of(p) for p in PROMPTS])
    return {p: TOK.decode(g.token_ids) for p, g in zip(PROMPTS, out, strict=True)}


def run_mesh(tmp_path, checksum: str):
    m = Mesh(tmp_path)
    try:
        flags = (*WORKER_FLAGS, "--kv-checksum", checksum)
        p_bad = m.start_prefill(*flags, "--faults", "misroute_kv=0.5,fault_seed=2", wait=False)
        p_ok = m.start_prefill(*flags, wait=False)
        d_bad = m.start_decode(*flags, "--faults", "corrupt_kv=0.5,fault_seed=1", wait=False)
        d_ok = m.start_decode(*flags, wait=False)
        for w in (p_bad, p_ok, d_bad, d_ok):
            m.wait_healthy(w)
        r = m.start_router([p_bad, p_ok], [d_bad, d_ok], *ROUTER_FLAGS)

        def one(prompt: str) -> tuple[int, str]:
            body = {"model": "pdmesh-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "temperature": 0.0 if SEEDS[prompt] is None else 0.8}
            if SEEDS[prompt] is not None:
                body["seed"] = SEEDS[prompt]
            resp = httpx.post(r.http_url + "/v1/completions", json=body, timeout=90)
            return resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text

        with ThreadPoolExecutor(4) as pool:
            results = dict(zip(PROMPTS, pool.map(one, PROMPTS), strict=True))
        # rooms a fault struck (a room through both faulty workers may be struck twice, and fails once)
        faults = len(_struck_rooms(p_bad.log(), "FAULT: KV pages misrouted")
                     | _struck_rooms(d_bad.log(), "FAULT: KV page corrupted after its WRITE landed"))
        caught = sum(d.metrics().get("pdmesh:kv_integrity_failures_total", 0) for d in (d_bad, d_ok))
        m.assert_invariants()
        wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs", 1) == 0, 10, "no admission slot held")
        return results, faults, caught
    finally:
        m.close()


def _struck_rooms(log: str, event_prefix: str) -> set[int]:
    """The rooms of a worker's JSON log lines whose event starts with `event_prefix`."""
    rooms = set()
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and str(entry.get("event", "")).startswith(event_prefix):
            rooms.add(entry["room"])
    return rooms


def test_corrupt_and_misrouted_kv_never_reach_a_client(tmp_path, reference):
    results, faults, caught = run_mesh(tmp_path, "on")
    assert faults >= 2, "the faults never struck: the scenario proves nothing"
    assert {p: code for p, (code, _) in results.items()} == {p: 200 for p in PROMPTS}
    wrong = [p for p, (_, text) in results.items() if text != reference[p]]
    assert wrong == [], f"{len(wrong)} wrong outputs with the checksum on"
    assert caught == faults  # every room a fault struck was caught on decode, once


def test_without_the_checksum_the_same_faults_give_wrong_answers(tmp_path, reference):
    results, faults, caught = run_mesh(tmp_path, "off")
    assert faults >= 2 and caught == 0
    assert all(code == 200 for code, _ in results.values())
    wrong = [p for p, (_, text) in results.items() if text != reference[p]]
    assert wrong, "the faults struck yet every output is right: the control shows nothing"
