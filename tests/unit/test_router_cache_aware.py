"""The cache_aware policy (the routing rule, services/router/policy.py) as pure logic, and the
pool feeding it (services/router/pool.py): a conversation sticks to the workers that hold it,
load wins when imbalanced, and a worker's entries go when it restarts (new epoch) or is ejected."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.router.policy import CacheAware, CacheThresholds, make_policy
from services.router.pool import WorkerHandle, WorkerPool
from services.router.prefix_index import RequestKeys

P = 4


@dataclass
class View:
    total: int
    held: dict = field(default_factory=dict)

    def matched(self, w) -> int:
        return self.held.get(w, 0)


def test_without_a_prefix_it_is_least_loaded_with_ties_alternating():
    ca = make_policy("cache_aware")
    assert isinstance(ca, CacheAware)
    assert [ca.choose(["a", "b"], lambda w: 0) for _ in range(4)] == ["a", "b", "a", "b"]
    assert ca.choose(["a", "b"], {"a": 2, "b": 1}.__getitem__, View(100)) == "b"  # nothing matched


def test_the_longest_match_wins_over_a_little_more_load():
    ca = CacheAware(CacheThresholds(cache=0.5, balance_abs=4, balance_rel=1.5))
    load = {"a": 3, "b": 0}.__getitem__
    assert ca.choose(["a", "b"], load, View(100, {"a": 80, "b": 16})) == "a"
    # below the cache threshold the match does not decide: least loaded
    assert ca.choose(["a", "b"], load, View(100, {"a": 48})) == "b"
    assert ca.choose(["a", "b"], load, View(100, {"a": 50})) == "a"  # at the threshold it does


def test_imbalance_needs_both_thresholds_then_load_wins():
    ca = CacheAware(CacheThresholds(cache=0.5, balance_abs=4, balance_rel=1.5))
    view = View(100, {"a": 96})
    assert ca.choose(["a", "b"], {"a": 5, "b": 0}.__getitem__, view) == "b"  # gap 5 > 4 and 5 > 0 * 1.5
    assert ca.choose(["a", "b"], {"a": 4, "b": 0}.__getitem__, view) == "a"  # gap 4: not beyond abs
    assert ca.choose(["a", "b"], {"a": 20, "b": 14}.__getitem__, view) == "a"  # gap 6 but 20 < 14 * 1.5
    assert ca.choose(["a", "b"], {"a": 22, "b": 14}.__getitem__, view) == "b"  # gap 8 and 22 > 21


def test_equal_matches_go_to_the_least_loaded_of_them():
    ca = CacheAware()
    load = {"a": 2, "b": 1, "c": 0}.__getitem__
    assert ca.choose(["a", "b", "c"], load, View(64, {"a": 48, "b": 48, "c": 16})) == "b"


def test_thresholds_are_checked():
    for bad in ({"cache": 1.5}, {"cache": -0.1}, {"balance_abs": -1}, {"balance_rel": 0.5}):
        with pytest.raises(ValueError):
            CacheThresholds(**bad)


# --- the pool: index, epochs, ejection -----------------------------------------------------------


def pool_of(prefills: int, decodes: int, **kw) -> WorkerPool:
    pool = WorkerPool([], [], policy="cache_aware", lane=False, **kw)
    pool.prefills = [WorkerHandle("prefill", f"p{i}:1", healthy=True, prefix_page_size=P) for i in range(prefills)]
    pool.decodes = [WorkerHandle("decode", f"d{i}:1", healthy=True, prefix_page_size=P) for i in range(decodes)]
    return pool


def route(pool: WorkerPool, ids: list[int], finished: bool = True) -> tuple[WorkerHandle, WorkerHandle]:
    """Choose a pair for `ids`; `finished`: the request then finished on the decode, which the
    orchestrator tells the pool (here with the prompt alone: no reply)."""
    async def run():
        keys = RequestKeys(ids)
        lease = await pool.choose_pair(prompt=keys)
        p, d = lease
        lease.release()
        if finished:
            pool.remember(d, keys)
        return p, d

    return asyncio.run(run())


def conversation(n: int, tag: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def test_conversations_spread_then_stick_to_their_workers():
    pool = pool_of(2, 2)
    firsts = [route(pool, conversation(20, c)) for c in range(4)]
    assert [(p.addr, d.addr) for p, d in firsts] == [("p0:1", "d0:1"), ("p1:1", "d1:1")] * 2
    for _ in range(3):  # later rounds: the whole history plus a little, each to its own pair
        for c in range(4):
            grown = conversation(20, c) + [7, 7, 7]
            assert route(pool, grown) == firsts[c]


def test_decode_is_remembered_only_once_a_request_finishes_there():
    """A request whose transfer fails leaves decode without its pages: the index must not say
    otherwise. Prefill is remembered when chosen (it caches what it computes)."""
    pool = pool_of(1, 2)
    ids = conversation(20, 1)
    p, d = route(pool, ids, finished=False)
    assert pool.index.pages(p) == 5 and pool.index.pages(d) == 0
    other = route(pool, ids)[1]
    assert other is not d  # nothing held anywhere: least loaded, ties alternate
    assert route(pool, ids + [3] * 8)[1] is other and pool.index.pages(other) == 7


def test_decode_remembers_the_reply_too():
    pool = pool_of(1, 2)
    prompt = RequestKeys(conversation(10, 1))
    (p, d) = route(pool, prompt.token_ids)
    pool.remember(d, prompt.extended(prompt.token_ids + [5] * 9))  # 19 ids: 4 full pages
    other = next(w for w in pool.decodes if w is not d)
    assert pool.index.pages(d) == 4 and pool.index.pages(p) == 2 and pool.index.pages(other) == 0


def test_a_new_epoch_or_an_ejection_forgets_the_worker():
    pool = pool_of(1, 2)
    ids = conversation(20, 1)
    _, d = route(pool, ids)
    pool._note_epoch(d, 111, P)  # the first epoch heard: nothing to forget
    assert pool.index.pages(d) == 5
    pool._note_epoch(d, 111, P)
    assert pool.index.pages(d) == 5
    pool._note_epoch(d, 222, P)  # restarted: its cache is empty now
    assert pool.index.pages(d) == 0 and d.epoch == 222
    _, d = route(pool, ids)
    assert route(pool, ids)[1] is d and pool.index.pages(d) == 5
    pool._note_epoch(d, 222, 0)  # its prefix cache is off now: keys mean nothing
    assert pool.index.pages(d) == 0
    pool._note_epoch(d, 222, P)
    route(pool, ids)
    pool._mark(d, False, "probe failed")
    assert pool.index.pages(d) == 0


def test_a_worker_without_a_prefix_cache_is_never_matched():
    pool = pool_of(1, 2)
    for w in pool.decodes:
        w.prefix_page_size = 0
    ids = conversation(20, 1)
    picks = {route(pool, ids)[1].addr for _ in range(4)}
    assert picks == {"d0:1", "d1:1"} and pool.index.pages(pool.decodes[0]) == 0


def test_the_index_cap_holds_per_worker():
    pool = pool_of(1, 1, prefix_index_max_pages=3)
    route(pool, conversation(40, 1))
    assert pool.index.pages(pool.decodes[0]) == 3
    pool.decodes[0].capacity_tokens = 2 * P  # its KV pool holds 2 pages
    route(pool, conversation(40, 2))
    assert pool.index.pages(pool.decodes[0]) == 2


def test_reset_prefix_cache_empties_the_router_index_too():
    from services.router.cache_reset import reset_prefix_caches

    pool = pool_of(1, 2)
    route(pool, conversation(20, 1))
    route(pool, conversation(20, 2))
    answer = asyncio.run(reset_prefix_caches(pool))  # these workers have no channel: none is asked
    assert answer["router_index_pages_dropped"] == 20  # 5 pages each: twice on the prefill, once per decode
    assert all(pool.index.pages(w) == 0 for w in pool.workers)
