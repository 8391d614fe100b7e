"""Conditional disaggregation (services/router/conditional_disagg.py): the rule as pure logic,
and the pool applying it (services/router/pool.py choose_pair): a decode holding all but a
short tail of the prompt serves it alone (prefill None), anything else goes PD as before."""

from __future__ import annotations

import asyncio

from services.router.conditional_disagg import goes_local
from services.router.pool import WorkerHandle, WorkerPool
from services.router.prefix_index import RequestKeys

P = 4


def test_a_short_uncached_tail_goes_local():
    assert goes_local(prompt_tokens=100, held_tokens=96, page_size=16, max_tokens=512)
    assert goes_local(prompt_tokens=600, held_tokens=96, page_size=16, max_tokens=504)  # exactly the threshold
    assert not goes_local(prompt_tokens=601, held_tokens=96, page_size=16, max_tokens=504)  # one beyond


def test_nothing_held_no_cache_or_the_rule_off_goes_pd():
    assert not goes_local(prompt_tokens=10, held_tokens=0, page_size=16, max_tokens=512)  # short but not held
    assert not goes_local(prompt_tokens=20, held_tokens=8, page_size=16, max_tokens=512)  # less than a page
    assert goes_local(prompt_tokens=20, held_tokens=16, page_size=16, max_tokens=512)  # one page is enough
    assert not goes_local(prompt_tokens=20, held_tokens=16, page_size=0, max_tokens=512)  # no prefix cache
    assert not goes_local(prompt_tokens=20, held_tokens=16, page_size=16, max_tokens=0)  # turned off


def pool_of(prefills: int, decodes: int, policy: str = "cache_aware", **kw) -> WorkerPool:
    pool = WorkerPool([], [], policy=policy, lane=False, **kw)
    pool.prefills = [WorkerHandle("prefill", f"p{i}:1", healthy=True, prefix_page_size=P) for i in range(prefills)]
    pool.decodes = [WorkerHandle("decode", f"d{i}:1", healthy=True, prefix_page_size=P) for i in range(decodes)]
    return pool


def route(pool: WorkerPool, ids: list[int], allow_local: bool = True, **kw) -> tuple[WorkerHandle | None, WorkerHandle]:
    async def run():
        pair = await pool.choose_pair(prompt=RequestKeys(ids), allow_local=allow_local, **kw)
        prefill, decode = pair
        pair.release()
        return prefill, decode

    return asyncio.run(run())


def conversation(n: int) -> list[int]:
    return [3 + i % 250 for i in range(n)]


def test_a_later_round_with_a_short_new_part_skips_prefill():
    pool = pool_of(1, 2, local_prefill_max_tokens=8)
    first = conversation(40)
    p, d = route(pool, first)
    assert p is not None  # round 1: nothing held anywhere, PD
    pool.remember(d, RequestKeys(first).extended(first + [9] * 3))  # decode keeps prompt + reply
    second = first + [9] * 4 + [7] * 4  # 48 ids, decode holds 40 (+3 of the reply: 10 full pages)
    p2, d2 = route(pool, second)
    assert p2 is None and d2 is d  # 8 uncached tokens <= 8: decode alone
    assert all(w.inflight == 0 for w in pool.workers)  # no prefill lease was taken


def test_a_long_new_part_or_a_request_that_must_not_goes_pd():
    pool = pool_of(1, 1, local_prefill_max_tokens=8)
    first = conversation(40)
    _, d = route(pool, first)
    pool.remember(d, RequestKeys(first))
    assert route(pool, first + [7] * 20)[0] is not None  # 20 uncached tokens > 8
    assert route(pool, first + [7] * 4, allow_local=False)[0] is not None  # n > 1 share, prompt logprobs
    # a choice of n > 1 told which prefill to take never skips it
    assert route(pool, first + [7] * 4, allow_local=False, prefill=pool.prefills[0])[0] is pool.prefills[0]
    assert route(pool, first + [7] * 4)[0] is None


def test_off_by_flag_by_policy_or_without_a_prefix_cache():
    ids = conversation(40)
    for pool in (pool_of(1, 1, local_prefill_max_tokens=0),
                 pool_of(1, 1, policy="round_robin", local_prefill_max_tokens=512)):
        pool.remember(pool.decodes[0], RequestKeys(ids))
        assert route(pool, ids + [1])[0] is pool.prefills[0]
    pool = pool_of(1, 1, local_prefill_max_tokens=512)
    pool.remember(pool.decodes[0], RequestKeys(ids))
    pool.decodes[0].prefix_page_size = 0  # its cache is off (and the index forgets it at the next Load)
    assert route(pool, ids + [1])[0] is pool.prefills[0]


def test_it_follows_the_decode_the_policy_picks_not_the_best_holder():
    pool = pool_of(1, 2, local_prefill_max_tokens=512, cache_thresholds=None)
    ids = conversation(40)
    holder = pool.decodes[0]
    pool.remember(holder, RequestKeys(ids))
    holder.external_load = 100  # imbalanced: the idle decode wins, and it holds nothing
    p, d = route(pool, ids + [1])
    assert d is pool.decodes[1] and p is pool.prefills[0]
    holder.external_load = 0
    assert route(pool, ids + [1]) == (None, holder)


def test_colocated_mode_is_unchanged():
    pool = pool_of(0, 1, colocated=True, local_prefill_max_tokens=512)
    assert pool.local_prefill_max_tokens == 0
    assert route(pool, conversation(10)) == (None, pool.decodes[0])


# --- through the router app, against scripted gRPC workers (services/fakes/workers.py) ---------------


def test_a_held_prompt_goes_local_and_a_failed_local_attempt_goes_pd():
    import grpc

    from services.fakes.workers import Behaviour
    from tests.unit.test_router_app import Cluster, post, wait_for

    c = Cluster()
    try:
        for w in (*c.prefills, *c.decodes):
            w.prefix_cache_page_size = P
        c.call(c.router.pool.probe_all())  # the page size is known before the first request
        prefill, decode = c.prefills[0], c.decodes[0]
        body = {"model": "pdmesh-tiny", "prompt": list(range(10, 50)), "max_tokens": 3, "ignore_eos": True}

        def send() -> None:
            resp = post(c, "/v1/completions", body)
            assert resp.status_code == 200, resp.text

        send()  # nothing held yet: PD (prefill's call may be read after the response: the fake decode never waits)
        wait_for(lambda: len(prefill.seen.requests) == 1, 5, "prefill to see the request")
        assert not decode.seen.requests[-1].colocated
        send()  # decode holds the prompt (and its reply) now: decode alone
        assert len(prefill.seen.requests) == 1
        last = decode.seen.requests[-1]
        assert last.colocated and not last.prefill_addr
        # prompt logprobs make decode compute the whole prompt: PD (the fake prefill sends none,
        # so the request fails; that it went to prefill is what counts here)
        seen = len(decode.seen.requests)
        post(c, "/v1/completions", {**body, "prompt_logprobs": 1})
        assert len(prefill.seen.requests) > 1 and not any(r.colocated for r in decode.seen.requests[seen:])
        before = len(prefill.seen.requests)
        decode.behaviour = Behaviour(mode="fail", code=grpc.StatusCode.UNAVAILABLE, times=1)
        send()  # the local attempt fails; the fail-over goes PD
        assert [r.colocated for r in decode.seen.requests[-2:]] == [True, False]
        assert len(prefill.seen.requests) == before + 1
        local = c.router.metrics.router_local_prefill_requests.labels(**c.router.metrics.labels)._value.get()
        assert local == 2
    finally:
        c.close()
