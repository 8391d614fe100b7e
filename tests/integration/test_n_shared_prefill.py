"""n > 1 computes the prompt once, through the prefill's prefix cache, on real processes (random
byte-level model: outputs must match exactly whichever compute path a choice took).

- Through the router (two prefills, two decodes): n = 4 with a seed gives four completions,
  reproducible across runs, choice i equal to the n = 1 completion with seed + i; on a fresh
  prompt the prefills' prompt-token counters together grow by one prompt and three tails (the
  last partial page each other choice computes), and one prefill's cache served the three
  others the rest (prefix_cache_hits_total, shared_prompt_tokens_total).
- A client that disconnects mid-stream ends all four choices.
- On the workers' RPCs directly (a slow prefill: 1 s per forward, 32-token chunks, so followers
  really wait): a follower aborted while it waits, and a leader aborted while followers wait —
  the common prompt is still computed once, and the others finish with the tokens an unshared
  request gets.
After each scenario every queue gauge is 0 and every KV pool whole.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.fakes.worker_client import generate
from tests.integration.mesh import Mesh, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "builtin-random"
COMPUTED, SHARED = "pdmesh:prompt_tokens_total", "pdmesh:shared_prompt_tokens_total"
HITS = "pdmesh:prefix_cache_hits_total"
PAGE = 16  # the workers' default --page-size


def tail(prompt_len: int) -> int:
    """What a follower computes itself: the prompt past its full pages but the last one's token."""
    return prompt_len - (prompt_len - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("nshare"))
    try:
        model = ("--model", MODEL)
        ps = [m.start_prefill(*model, wait=False) for _ in range(2)]
        slow = m.start_prefill(*model, "--faults", "delay_forward=1", "--chunked-prefill-size", "32", wait=False)
        ds = [m.start_decode(*model, wait=False) for _ in range(2)]
        for w in (*ps, slow, *ds):
            m.wait_healthy(w)
        r = m.start_router(ps, ds, *model, "--request-timeout", "60")
        yield m, ps, slow, ds, r
    finally:
        m.close()


def _total(procs, name):
    return sum(p.metrics().get(name, 0.0) for p in procs)


def _post(r, body) -> dict:
    resp = httpx.post(r.http_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _texts(r, body):
    return [c["text"] for c in sorted(_post(r, body)["choices"], key=lambda c: c["index"])]


def test_n4_computes_the_prompt_once_and_equals_n1_with_the_derived_seeds(mesh):
    m, ps, _, _, r = mesh
    prompt = "".join(random.Random(5).choice("abcdefghij klmnop") for _ in range(300))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 77, "n": 4}
    computed, shared, hits = _total(ps, COMPUTED), _total(ps, SHARED), _total(ps, HITS)
    out = _post(r, body)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    prompt_len = out["usage"]["prompt_tokens"]
    assert prompt_len > 2 * PAGE
    assert _total(ps, COMPUTED) - computed == prompt_len + 3 * tail(prompt_len)  # not 4 x
    # the three others took the rest from the cache, as the leader's followers
    assert _total(ps, HITS) - hits == _total(ps, SHARED) - shared == 3 * (prompt_len - tail(prompt_len))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_len - tail(prompt_len)
    assert 0 in [p.metrics()[SHARED] for p in ps]  # all four went to one prefill
    assert len(set(texts)) == 4
    assert _texts(r, body) == texts
    for i in range(4):
        assert _texts(r, {**body, "n": 1, "seed": 77 + i}) == [texts[i]]
    m.assert_invariants()


def test_client_disconnect_mid_stream_ends_every_choice(mesh):
    m, ps, _, _, r = mesh
    prompt = "".join(random.Random(6).choice("qrstuvwxyz ") for _ in range(1500))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 1.0, "seed": 5, "n": 4,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", r.http_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(line for line in resp.iter_lines() if line.startswith("data: {"))
    # the client went away with four decodes running: every room ends, every page comes back
    m.assert_invariants(timeout=30)


PARAMS = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, ignore_eos=True) for s in (11, 12, 13)]
LEN = 96  # three 32-token chunks: 3 s of forwards; a follower takes 5 pages and computes 16 tokens


def _ids(seed: int) -> list[int]:
    """A prompt of its own per scenario: the slow prefill's cache must not serve it already."""
    return [random.Random(seed).randrange(32, 127) for _ in range(LEN)]


async def _group(slow, d, ids, cancel: int, key: int):
    """Three requests of one share key; `cancel` (by index) is cancelled — the client went away —
    once the first is in its forward and the other two wait for it."""
    tasks = []
    tasks.append(asyncio.ensure_future(generate(slow.grpc_addr, d.grpc_addr, ids, PARAMS[0], share_key=key)))
    await asyncio.to_thread(wait_for, lambda: slow.metrics()["pdmesh:num_running_reqs"] == 1, 30, "leader forward")
    for p in PARAMS[1:]:
        tasks.append(asyncio.ensure_future(generate(slow.grpc_addr, d.grpc_addr, ids, p, share_key=key)))
    await asyncio.to_thread(wait_for, lambda: slow.metrics()["pdmesh:num_queue_reqs"] == 2, 30, "followers waiting")
    tasks[cancel].cancel()
    return await asyncio.gather(*tasks, return_exceptions=True)


def _unshared(p, d, ids):
    async def run():
        return await asyncio.gather(*(generate(p.grpc_addr, d.grpc_addr, ids, pa) for pa in PARAMS))
    return [o.tokens for o in asyncio.run(run())]


@pytest.mark.parametrize("cancel", [pytest.param(1, marks=pytest.mark.long), 0], ids=["follower_aborted", "leader_aborted"])
def test_an_aborted_member_leaves_the_others_exact(mesh, cancel):
    m, ps, slow, ds, _ = mesh
    ids = _ids(100 + cancel)
    computed, shared = slow.metrics().get(COMPUTED, 0.0), slow.metrics().get(SHARED, 0.0)
    outcomes = asyncio.run(_group(slow, ds[0], ids, cancel, random.getrandbits(63) | 1))
    m.assert_invariants()
    assert isinstance(outcomes[cancel], asyncio.CancelledError)
    rest = [i for i in range(3) if i != cancel]
    assert all(outcomes[i].ok for i in rest), [outcomes[i] for i in rest]
    # the common prompt computed once either way: an aborted leader's finished chunks stay cached
    # for the follower that leads after it, which computes only the rest; the last one follows
    assert slow.metrics()[COMPUTED] - computed == LEN + tail(LEN)
    assert slow.metrics()[SHARED] - shared == LEN - tail(LEN)
    reference = _unshared(ps[0], ds[1], ids)  # unchunked, unshared, on other workers
    assert [outcomes[i].tokens for i in rest] == [reference[i] for i in rest]
    m.assert_invariants()
