"""Cache-aware routing through the real mesh (2 prefill + 2 decode + router; real gRPC, HTTP and NIXL).

- 8 conversations of different lengths and think times, one of them twice as busy as the rest
  (twice the rounds), each over its own keep-alive connection. They start one after another,
  then run side by side. Every round is the whole history (prompt + reply token ids, as the
  workers produced them) plus a few new tokens. From round 2 on >= 90 % of rounds hit, judged
  by the workers' count (`usage.prompt_tokens_details.cached_tokens`, prefill's), decode's own
  cache hits at least as much, and the rounds each decode served (its own request counter) stay
  within +-25 % of the mean.
- A decode restarted between requests makes a router forget what it routed there as soon as
  its Load reply shows the new epoch: no request failed, and the worker was never ejected (that
  router has no lane and a failure threshold the restart does not reach); the other decode's
  entries stay.

Both end with mesh.assert_invariants().
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.integration.mesh import Mesh, in_background, wait_for

pytestmark = pytest.mark.integration

CONVERSATIONS = 8
ROUNDS = 5  # the busy conversation has twice as many
REPLY = 8  # max_tokens per round


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("cache-aware"))
    try:
        ps, ds = m.start_workers(2, 2)
        # reuse measured with conditional disaggregation off: every round through a prefill
        r = m.start_router(ps, ds, "--request-timeout", "60", "--local-prefill-max-tokens", "0", wait=False)
        # Nothing but the epoch may tell this one of a restart: no lane (whose stream breaking
        # would eject the worker at once), and a failure threshold a restart never reaches.
        quiet = m.start_router(ps, ds, "--worker-lane", "false", "--health-check-interval", "0.2",
                               "--health-failure-threshold", "100000", "--request-timeout", "60", "--local-prefill-max-tokens", "0",
                               wait=False)
        m.wait_healthy(r)
        m.wait_healthy(quiet)
        yield m, ps, ds, r, quiet
    finally:
        m.close()


def requests_served(proc) -> float:
    return proc.metrics().get("pdmesh:num_requests_total", 0.0)


def decode_hits(proc) -> float:
    return proc.metrics().get("pdmesh:prefix_cache_hits_total", 0.0)


class Conversation:
    def __init__(self, base_url: str, number: int, rounds: int, seed: int):
        self.rng = random.Random(seed)
        self.rounds = rounds
        self.think = self.rng.uniform(0.0, 0.03)  # seconds between rounds: the workload's shape only
        self.history = [self.rng.randrange(3, 256) for _ in range(40 + 23 * number)]  # 40..201 tokens
        self.client = httpx.Client(base_url=base_url, timeout=60)
        self.cached: list[int] = []  # usage's cached_tokens, round by round

    def one_round(self) -> None:
        resp = self.client.post("/v1/completions", json={
            "model": "pdmesh-tiny", "prompt": self.history, "max_tokens": REPLY, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        self.cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        reply = body["choices"][0]["token_ids"]
        assert len(reply) == REPLY
        self.history = self.history + reply + [self.rng.randrange(3, 256) for _ in range(self.rng.randrange(8, 40))]

    def rest(self) -> None:
        for _ in range(self.rounds - 1):
            time.sleep(self.think)  # a user's think time; nothing waits on it
            self.one_round()


def test_conversations_hit_their_caches_while_decodes_share_the_rounds(mesh):
    m, ps, ds, r, _ = mesh
    before = [requests_served(d) for d in ds]
    hits_before = sum(decode_hits(d) for d in ds)
    convs = [Conversation(r.http_url, i, ROUNDS * (2 if i == 3 else 1), seed=100 + i) for i in range(CONVERSATIONS)]
    try:
        for c in convs:  # they start one after another: new conversations spread over the workers
            c.one_round()
        # where the new conversations went: their rounds stay there, so this is the split
        first_rounds = [requests_served(d) - b for d, b in zip(ds, before, strict=True)]
        threads = [in_background(c.rest) for c in convs]
        for t, out in threads:
            t.join(timeout=100)
            assert not t.is_alive(), "a conversation did not finish"
            assert "out" in out, "a conversation failed (its exception is printed above)"
    finally:
        for c in convs:
            c.client.close()
    later = [cached for c in convs for cached in c.cached[1:]]
    assert len(later) == (CONVERSATIONS + 1) * ROUNDS - CONVERSATIONS
    hit = sum(1 for cached in later if cached > 0)
    assert hit >= 0.9 * len(later), f"{hit} of {len(later)} later rounds hit: {[c.cached for c in convs]}"
    assert all(c.cached[0] == 0 for c in convs)  # nothing shared between conversations
    # decode holds prompt + reply, prefill only the prompt: decode's hits are the larger
    assert sum(decode_hits(d) for d in ds) - hits_before >= sum(later)
    served = [requests_served(d) - b for d, b in zip(ds, before, strict=True)]
    mean = sum(served) / len(served)
    assert sum(served) == (CONVERSATIONS + 1) * ROUNDS
    print(f"later rounds hit: {hit} of {len(later)}; rounds per decode: {served}")  # the figure docs/router.md quotes
    assert all(abs(s - mean) <= 0.25 * mean for s in served), (
        f"rounds per decode {served}; first rounds per decode {first_rounds}")
    m.assert_invariants()


def index_pages(r, addr: str) -> int:
    return httpx.get(r.http_url + "/health", timeout=5).json()["decode"][addr]["prefix_index_pages"]


def test_a_restarted_decode_is_forgotten_without_a_failed_request(mesh):
    m, ps, ds, _, r = mesh
    body = {"model": "pdmesh-tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    for i in range(4):  # new conversations alternate: both decodes get some
        resp = httpx.post(r.http_url + "/v1/completions", json={**body, "prompt": [9 + i] * 64}, timeout=60)
        assert resp.status_code == 200, resp.text
    victim, other = ds
    wait_for(lambda: index_pages(r, victim.grpc_addr) > 0 and index_pages(r, other.grpc_addr) > 0, 5,
             "the router to index both decodes")
    kept = index_pages(r, other.grpc_addr)
    before = r.log().count("worker restarted (new epoch)")
    new = m.restart(victim)
    ds[0] = new
    wait_for(lambda: r.log().count("worker restarted (new epoch)") > before, 30,
             "the router to see the decode's new epoch")
    assert index_pages(r, new.grpc_addr) == 0 and index_pages(r, other.grpc_addr) == kept
    assert "worker ejected" not in r.log()  # it was the epoch, not an ejection, that made it forget
    resp = httpx.post(r.http_url + "/v1/completions", json={**body, "prompt": [9] * 64}, timeout=60)
    assert resp.status_code == 200, resp.text
    m.assert_invariants()


