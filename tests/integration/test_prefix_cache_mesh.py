"""The prefix cache through the real mesh (router, prefill, decode; real gRPC, HTTP and NIXL):
a 16-round conversation growing to ~2,000 tokens, greedy and seeded, streamed and not, must produce exactly
what single-process generation does, with the cache warm, after POST /reset_prefix_cache, and
on workers started with --prefix-cache off; from round 2 on prefill computes only the round's new
tokens (plus at most one page): what its own cache lacks of the previous prompt and reply it READs
from the pages decode holds (--kv-read-held-prefix), the KV moved is only the pages decode lacks,
and usage reports the cached tokens; a request's cache_salt confines what it finds to its own
salt. With the READ off, or failing (a wrong checksum, a READ that
never answers), prefill computes the reply again and the output stays the same."""

from __future__ import annotations

import random

import httpx
import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import Mesh, labelled_samples, mesh_with_router, wait_for

pytestmark = pytest.mark.integration

P = 16  # the workers' default page size
TOK = load_tokenizer(None)  # the default model's: models/pdmesh-tiny


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # reuse measured with conditional disaggregation off: every round through prefill
    router_flags = ("--request-timeout", "60", "--local-prefill-max-tokens", "0")
    with mesh_with_router(tmp_path_factory.mktemp("prefix"), router_flags=router_flags) as (m, (p,), (d,), r):
        yield m, p, d, r


@pytest.fixture(scope="module")
def reference_model():
    return load_model(None)


def reference(model, prompt, params):
    pool = KVPool(model.config, num_pages=512, page_size=P)
    return generate_full(model.model, pool, [prompt], [params])[0].token_ids


def body(prompt, max_tokens, seed=None):
    b = {"model": "pdmesh-tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return {**b, "temperature": 0.8, "seed": seed} if seed is not None else {**b, "temperature": 0}


def generated_text(r, prompt, max_tokens, seed=None, stream=False):
    if stream:
        events = stream_events(r.http_url, "/v1/completions",
                               {**body(prompt, max_tokens, seed), "stream_options": {"include_usage": True}})
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events[-1]["usage"]
    out = post_json(r.http_url, "/v1/completions", body(prompt, max_tokens, seed))
    return out["choices"][0]["text"], out["usage"]


def decode_text(ids):
    return TOK.decode(ids)


def delta(after, before, name):
    return after.get(name, 0) - before.get(name, 0)


REPLY = 8  # tokens generated per round


def converse(r, p, reference_model, n_rounds, read=True, seed=11):
    """A conversation of n_rounds (prompts as token ids: the reply's ids come back unchanged, as
    the router's own tokens would), each round checked against single-process generation and
    against the prefill and transfer bounds. Returns per round (prompt tokens, computed by
    prefill, KV bytes moved, cached tokens in usage, pages READ)."""
    rng = random.Random(seed)
    page_nbytes = KVPool(reference_model.config, 1, P).page_nbytes
    history = [rng.randrange(3, 256) for _ in range(90)]
    rounds = []
    for i in range(n_rounds):
        seed_i = None if i % 2 == 0 else 100 + i
        params = SamplingParams(temperature=0.8 if seed_i is not None else 0.0, seed=seed_i, max_tokens=REPLY,
                                ignore_eos=True)
        ref = reference(reference_model, history, params)
        before = p.metrics()
        text, usage = generated_text(r, history, REPLY, seed_i, stream=i % 2 == 1)
        after = p.metrics()
        assert text == decode_text(ref), f"round {i + 1}"
        computed = delta(after, before, "pdmesh:prompt_tokens_total")
        moved = delta(after, before, "pdmesh:kv_transfer_bytes_sum")
        read_pages = delta(after, before, "pdmesh:kv_read_pages_total")
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        rounds.append((len(history), computed, moved, cached, read_pages))
        if i:
            prev_len = rounds[i - 1][0]
            new = len(history) - prev_len - REPLY  # beyond the previous prompt and reply
            held = (prev_len + REPLY - 1) // P  # decode cached prompt + reply but the last token
            if read:
                # prefill has the previous prompt's full pages; decode's held pages bring the rest
                # of the previous prompt and the reply: it computes the new tokens + at most a page
                assert computed <= new + P, f"round {i + 1}: computed {computed}, new {new}"
                assert read_pages == held - prev_len // P and cached == held * P
            else:
                # prefill computes what it does not hold: the previous prompt's partial page, the
                # reply (decode made it; prefill never saw it) and the new tokens
                assert computed <= len(history) - (prev_len // P) * P
                assert cached == (prev_len // P) * P and read_pages == 0
            # decode kept the previous prompt and reply: only the pages after them move (+ aux row)
            assert moved <= (-(-len(history) // P) - held) * page_nbytes + 64
            assert moved <= (-(-new // P) + 1) * page_nbytes + 64  # the new tokens' pages + 1
        else:
            assert computed == len(history) and cached == 0 and read_pages == 0
        history = history + ref + [rng.randrange(3, 256) for _ in range(120)]
    return rounds


# 16 rounds grow to ~2,000 tokens (make long-test); make test's short form stops at 8 (~1,000),
# the same checks on every round: the reference model recomputes the whole history each round.
@pytest.mark.parametrize("n_rounds", [8, pytest.param(16, marks=pytest.mark.long)])
def test_a_growing_conversation_reuses_its_prefix_and_matches_single_process(mesh, reference_model, n_rounds):
    m, p, d, r = mesh
    reads_before = p.metrics()
    rounds = converse(r, p, reference_model, n_rounds, seed=11 + n_rounds)  # its own history: nothing cached yet
    after = p.metrics()
    print("rounds (prompt tokens, computed, KV bytes, cached, pages read):", rounds)
    assert delta(after, reads_before, "pdmesh:kv_read_pages_total") == sum(x[4] for x in rounds) > 0
    assert delta(after, reads_before, "pdmesh:kv_read_failures_total") == 0
    md = d.metrics()
    assert md["pdmesh:prefix_cache_hits_total"] > 0 and md["pdmesh:prefix_cache_pages"] > 0
    assert p.metrics()["pdmesh:cache_hit_rate"] > 0
    m.assert_invariants()


def test_a_reply_that_comes_back_different_is_read_up_to_its_first_differing_page(mesh, reference_model):
    """A client's harness re-tokenizes the reply, and the ids may differ from those generated:
    decode's chain keys then miss from the page holding the first difference, so decode holds,
    and prefill READs, only the pages before it; what follows is computed, and the output is
    that of the prompt as sent."""
    m, p, d, r = mesh
    rng = random.Random(5)
    history = [rng.randrange(3, 256) for _ in range(90)]  # 5 full pages + 10 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reply = reference(reference_model, history, greedy)
    assert generated_text(r, history, 40)[0] == decode_text(reply)
    # decode cached prompt + reply but its last token: (90 + 39) // 16 = 8 pages. The reply comes
    # back with its 31st id changed: position 120, in page 7, so decode's hit stops at 7 pages
    changed = list(reply)
    changed[30] = 3 if changed[30] != 3 else 4
    prompt = history + changed + [rng.randrange(3, 256) for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=REPLY, ignore_eos=True)
    before = p.metrics()
    text, usage = generated_text(r, prompt, REPLY)
    after = p.metrics()
    assert text == decode_text(reference(reference_model, prompt, params))
    assert delta(after, before, "pdmesh:kv_read_pages_total") == 7 - 90 // P  # pages 5 and 6
    assert usage["prompt_tokens_details"]["cached_tokens"] == 7 * P
    assert delta(after, before, "pdmesh:prompt_tokens_total") == len(prompt) - 7 * P
    m.assert_invariants()


def test_a_cache_salt_shares_pages_only_with_requests_of_the_same_salt(mesh, reference_model):
    """vLLM's cache_salt: on prefill (its own cache) and on decode (what it holds and offers for
    the READ of the next round) a salted prompt finds only the pages of its own salt; the output
    is the same whatever the salt."""
    m, p, d, r = mesh
    rng = random.Random(23)
    prompt = [rng.randrange(3, 256) for _ in range(60)]  # 3 full pages + 12 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reply = reference(reference_model, prompt, greedy)

    def ask(ids, salt):
        out = post_json(r.http_url, "/v1/completions", {**body(ids, 20), **({"cache_salt": salt} if salt else {})})
        return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert ask(prompt, "tenant-a") == (decode_text(reply), 0)
    assert ask(prompt, "tenant-a") == (decode_text(reply), 48)  # prefill's cache, this salt
    assert ask(prompt, "tenant-b") == (decode_text(reply), 0)
    assert ask(prompt, None) == (decode_text(reply), 0)
    # the next round of tenant-a's conversation: decode holds prompt + reply under its salt (79
    # tokens: 4 full pages), prefill READs the page it lacks; tenant-c, with the same tokens, gets
    # nothing of it
    following = prompt + reply + [rng.randrange(3, 256) for _ in range(20)]
    expected = decode_text(reference(reference_model, following, greedy))
    before = p.metrics()
    assert ask(following, "tenant-a") == (expected, 64)
    assert delta(p.metrics(), before, "pdmesh:kv_read_pages_total") == 1
    assert ask(following, "tenant-c") == (expected, 0)
    resp = httpx.post(r.http_url + "/v1/completions", json={**body(prompt, 2), "cache_salt": ""}, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
    m.assert_invariants()


def test_reset_empties_every_cache_and_output_stays_the_same(mesh, reference_model):
    m, p, d, r = mesh
    prompt = [7 + (i * 13) % 240 for i in range(70)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = decode_text(reference(reference_model, prompt, greedy))
    assert generated_text(r, prompt, 6)[0] == ref
    warm, usage = generated_text(r, prompt, 6)
    assert warm == ref and usage["prompt_tokens_details"]["cached_tokens"] == 64
    for path in ("/reset_prefix_cache", "/flush_cache"):
        resp = httpx.post(r.http_url + path, timeout=10)
        assert resp.status_code == 200, resp.text
        assert {w["worker"].split(":")[0] for w in resp.json()["workers"]} == {"prefill", "decode"}
        assert all(w["ok"] and w["prefix_cache"] for w in resp.json()["workers"])
    wait_for(lambda: p.metrics()["pdmesh:prefix_cache_pages"] == 0 == d.metrics()["pdmesh:prefix_cache_pages"],
             5, "both caches empty")
    cold, usage = generated_text(r, prompt, 6, stream=True)
    assert cold == ref and usage["prompt_tokens_details"]["cached_tokens"] == 0
    m.assert_invariants()


def test_with_the_cache_off_nothing_is_reused_and_output_is_the_same(tmp_path, reference_model):
    m = Mesh(tmp_path)
    try:
        (p,), (d,) = m.start_workers(1, 1, ("--prefix-cache", "off"), ("--prefix-cache", "off"))
        r = m.start_router([p], [d], "--local-prefill-max-tokens", "0")
        prompt = [5 + (i * 11) % 250 for i in range(50)]
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
        ref = decode_text(reference(reference_model, prompt, seeded))
        for _ in range(2):
            text, usage = generated_text(r, prompt, 6, seed=3)
            assert text == ref and usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert p.metrics()["pdmesh:prompt_tokens_total"] == 2 * len(prompt)
        resp = httpx.post(r.http_url + "/reset_prefix_cache", timeout=10)
        assert resp.status_code == 200 and not any(w["prefix_cache"] for w in resp.json()["workers"])
        m.assert_invariants()
    finally:
        m.close()


def read_failures(p) -> dict[str, float]:
    text = httpx.get(p.http_url + "/metrics", timeout=5).text
    return {s["reason"]: v for s, v in labelled_samples(text, "pdmesh:kv_read_failures_total")}


def test_with_the_read_off_prefill_computes_the_reply_and_output_is_the_same(tmp_path, reference_model):
    m = Mesh(tmp_path)
    try:
        (p,), (d,) = m.start_workers(1, 1, ("--kv-read-held-prefix", "off"), ("--kv-read-held-prefix", "off"))
        r = m.start_router([p], [d], "--local-prefill-max-tokens", "0")
        converse(r, p, reference_model, 3, read=False)
        assert p.metrics()["pdmesh:kv_read_pages_total"] == 0
        m.assert_invariants()
    finally:
        m.close()


# A READ that fails falls back to computing: a wrong checksum in decode's offer (corrupt_kv_read),
# a READ never checked until its deadline (stall_kv_read, as one from a frozen decode).
@pytest.mark.parametrize("fault,prefill_args,decode_args", [
    pytest.param("checksum", (), ("--faults", "corrupt_kv_read"), marks=pytest.mark.long),
    ("timeout", ("--faults", "stall_kv_read", "--kv-read-timeout", "0.3"), ()),
])
def test_a_failed_read_falls_back_to_computing_and_output_is_the_same(tmp_path, reference_model, fault,
                                                                       prefill_args, decode_args):
    m = Mesh(tmp_path)
    try:
        (p,), (d,) = m.start_workers(1, 1, prefill_args, decode_args)
        r = m.start_router([p], [d], "--local-prefill-max-tokens", "0")
        converse(r, p, reference_model, 3, read=False)  # the bounds of no READ: it gave nothing
        assert read_failures(p)[fault] == 2  # rounds 2 and 3 each tried once
        assert p.metrics()["pdmesh:kv_read_pages_total"] == 0
        assert "READ of decode's held prefix failed" in p.log()
        m.assert_invariants(nixl=True)
    finally:
        m.close()
