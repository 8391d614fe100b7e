"""The chaos soak's multi-round conversations, and the check that they hit the prefix cache.

A conversation is one client on one keep-alive connection. Each round's prompt is the whole
history (every earlier round's prompt ids and generated ids) plus 80-120 new tokens, sent as
token ids to /v1/completions, greedy, a fixed `max_tokens`, streamed every other round; the
reply's ids (`return_token_ids`) join the history. A round that fails is recorded like any
other failed request and sent again (same history: it has no reply to add); after `ROUNDS`
rounds the conversation starts over with a new history. Rounds are `Result`s in the soak's
results, so invariants 1, 2 and 5 cover them like every other request.

The cache rule (docs/chaos.md, invariant 6): a round is quiet when no fault overlaps it, nor
ended less than `SETTLE_S` before it began; of the successful quiet rounds from round 2 on, at
least `MIN_HIT_SHARE` report `usage.prompt_tokens_details.cached_tokens > 0`.
"""

from __future__ import annotations

import asyncio
import random

import httpx

from chaos.soak_load import PRINTABLE, LoadState, Result, send_recorded

ROUNDS = 8  # rounds per conversation, then a fresh one (the context stays ~1,100 tokens at most)
NEW_TOKENS = (80, 120)  # new prompt tokens per round
MAX_TOKENS = 24
# after a fault ends: a restarted worker came back empty and the router forgot its entries, so
# the next round may rightly miss; a round that began this soon after is not quiet
SETTLE_S = 3.0
MIN_HIT_SHARE = 0.5


async def conversation_loop(state: LoadState, conv: int, seed: int, request_timeout: float) -> None:
    rng = random.Random(seed * 1000 + 500 + conv)  # apart from the clients' streams (seed * 1000 + c)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout + 15, connect=2)) as http:
        for k in range(1 << 30):
            if not state.running():
                return
            cid = conv * 1000 + k  # the k-th conversation of this client
            history: list[int] = []
            for rnd in range(1, ROUNDS + 1):
                history = history + [rng.choice(PRINTABLE) for _ in range(rng.randint(*NEW_TOKENS))]
                while state.running():
                    r = Result(id=state.next_id, client=-1 - conv, prompt=history, max_tokens=MAX_TOKENS,
                               temperature=0.0, seed=None, stream=rnd % 2 == 0, conversation=cid, round=rnd)
                    state.next_id += 1
                    sent = await send_recorded(http, state, r)
                    await asyncio.sleep(state.think)
                    if sent and r.ok:
                        history = history + r.token_ids
                        break
                if not state.running():
                    return


def cache_hits(results: list[Result], faults: list[dict], t0: float) -> dict:
    """Invariant 6's numbers: quiet rounds from round 2 on (successful), those with cached tokens."""
    windows = [(t0 + f["began"], t0 + f["ended"] + SETTLE_S) for f in faults]
    rounds = [r for r in results if r.conversation is not None]

    def quiet(r: Result) -> bool:
        return all(r.ended < b or r.started > e for b, e in windows)

    considered = [r for r in rounds if r.ok and r.round >= 2 and quiet(r)]
    hits = sum(1 for r in considered if (r.cached_tokens or 0) > 0)
    share = hits / len(considered) if considered else None
    return {"conversations": len({r.conversation for r in rounds}), "rounds": len(rounds),
            "rounds_ok": sum(r.ok for r in rounds), "deepest_round": max((r.round for r in rounds), default=0),
            "quiet_rounds_from_2": len(considered), "quiet_hits": hits,
            "quiet_hit_share": round(share, 3) if share is not None else None,
            "hits_all_rounds_from_2": sum(1 for r in rounds if r.ok and r.round >= 2 and (r.cached_tokens or 0) > 0),
            "ok": share is None or share >= MIN_HIT_SHARE}
