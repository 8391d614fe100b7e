"""n > 1 and the sampling controls through the router, on real prefill + decode processes.

- n = 4 with a seed: four completions, the same on a second run, choice i equal to the n = 1
  completion with seed + i; streamed, each delta carries its choice's `index` and the chunks
  reassemble to the same four texts; usage counts the prompt once and sums the completions.
  The prompt is computed once for all four (services/prefill/sharing.py): prefill's prompt-token
  counter grows by the prompt and three last partial pages, the rest served by its prefix cache.
- penalties and logit_bias set in the OpenAI request reach both workers: greedy output equals
  single-process generation with the same control.
One mesh for the module.
"""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "pdmesh-tiny"
TOK = load_tokenizer(None)  # the default model's: models/pdmesh-tiny


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("choices"), router_flags=("--request-timeout", "60")) as (
        m, (p,), (d,), r
    ):
        yield m, p, d, r


def test_n_choices_are_seeded_reproducible_and_streamed_with_their_index(router):
    m, p, d, r = router
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog, and then the dog wakes up and "
            "runs after it.", "max_tokens": 12, "temperature": 1.0, "seed": 1234, "n": 4, "ignore_eos": True}
    prompt_len = len(TOK.encode(body["prompt"]))
    tail = prompt_len - (prompt_len - 1) // 16 * 16  # past the full pages a follower takes (--page-size 16)
    before = p.metrics().get("pdmesh:prompt_tokens_total", 0.0)
    out = post_json(r.http_url, "/v1/completions", body)
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in sorted(out["choices"], key=lambda c: c["index"])] == [0, 1, 2, 3]
    assert len(set(texts)) > 1  # four different seeds
    assert out["usage"]["prompt_tokens"] == prompt_len
    assert out["usage"]["completion_tokens"] == 4 * 12
    assert out["usage"]["total_tokens"] == prompt_len + 48
    # the four choices share one prefill, which computed the prompt once; the three others took its
    # full pages from the prefix cache and computed only the tail
    assert prompt_len > 16 and p.metrics()["pdmesh:prompt_tokens_total"] - before == prompt_len + 3 * tail

    again = post_json(r.http_url, "/v1/completions", body)
    assert [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])] == texts
    for i in range(4):
        one = post_json(r.http_url, "/v1/completions", {**body, "n": 1, "seed": 1234 + i})
        assert one["choices"][0]["text"] == texts[i]

    events = stream_events(r.http_url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    streamed = ["", "", "", ""]
    finished = set()
    for ev in events:
        for c in ev["choices"]:
            streamed[c["index"]] += c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert streamed == texts and finished == {0, 1, 2, 3}
    assert events[-1]["usage"]["completion_tokens"] == 48

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 9, "n": 3}
    full = post_json(r.http_url, "/v1/chat/completions", chat)
    contents = [c["message"]["content"] for c in sorted(full["choices"], key=lambda c: c["index"])]
    deltas = ["", "", ""]
    roles = set()
    for ev in stream_events(r.http_url, "/v1/chat/completions", chat):
        for c in ev["choices"]:
            if c["delta"].get("role"):
                roles.add(c["index"])
            deltas[c["index"]] += c["delta"].get("content") or ""
    assert deltas == contents and roles == {0, 1, 2}
    m.assert_invariants()


def test_controls_set_in_the_request_reach_both_workers(router):
    m, p, d, r = router
    model = load_model(None)
    prompt = "abcabcabc hello hello"
    ids = TOK.encode(prompt)
    controls = [
        ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, dict(presence_penalty=1.5, frequency_penalty=0.7)),
        ({"repetition_penalty": 1.5}, dict(repetition_penalty=1.5)),
        ({"logit_bias": {str(ord("z")): 6.0}}, dict(logit_bias=((ord("z"), 6.0),))),
    ]
    for request, kw in controls:
        out = post_json(r.http_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                           "ignore_eos": True, **request})
        ref = generate_full(model.model, KVPool(model.config, 16, 16), [ids],
                            [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)])[0]
        assert out["choices"][0]["text"] == TOK.decode(ref.token_ids), request
    m.assert_invariants()
