"""vLLM's request features through the router on real prefill + decode processes.

- Batched prompts on /v1/completions: 8 prompts x n = 2 give 16 choices indexed prompt i x 2 + j,
  each equal to the single request for prompt i with seed + j (greedy and seeded), streamed too.
- min_p, allowed_token_ids and bad_words reach both workers (prefill samples the first token,
  decode the rest): the output equals single-process generation with the same parameters.
One mesh for the module; each scenario ends with the invariants.
"""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import load_tokenizer
from services.engine.kv_pool import KVPool
from services.engine.loader import load_model
from services.engine.local_generate import generate_full
from services.router.protocol import bad_word_sequences
from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
TOK = load_tokenizer(None)
PROMPTS = ["The quick brown fox", "Return the value", "A list of", "Open the file and", "If the argument is",
           "This module provides", "Raise an error when", "The default is"]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    with mesh_with_router(tmp_path_factory.mktemp("vllm"), router_flags=("--request-timeout", "120")) as (
        m, (p,), (d,), r
    ):
        yield m, p, d, r


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4321}],
                         ids=["greedy", "seeded"])
def test_batched_prompts_equal_single_requests(router, sampling):
    m, p, d, r = router
    body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 8, "ignore_eos": True, **sampling}
    out = post_json(r.http_url, "/v1/completions", body, timeout=120)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(16))
    seed = sampling.get("seed")
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):
            single = {**body, "prompt": prompt, "n": 1, **({"seed": seed + j} if seed is not None else {})}
            one = post_json(r.http_url, "/v1/completions", single)
            assert choices[2 * i + j]["text"] == one["choices"][0]["text"], (i, j)
    assert out["usage"]["prompt_tokens"] == sum(len(TOK.encode(x)) for x in PROMPTS)
    assert out["usage"]["completion_tokens"] == 16 * 8
    streamed = [""] * 16
    for ev in stream_events(r.http_url, "/v1/completions", body, timeout=120):
        for c in ev["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in choices]
    m.assert_invariants()


def test_token_masks_and_min_p_reach_both_workers(router):
    m, p, d, r = router
    model = load_model(None)
    prompt = "The quick brown fox"
    ids = TOK.encode(prompt)
    allowed = sorted(set(TOK.encode(" the a of and to in is", add_special_tokens=False)))
    words = ["the", "of"]
    cases = [
        ({"min_p": 0.25, "temperature": 1.0, "seed": 77}, dict(min_p=0.25, temperature=1.0, seed=77)),
        ({"allowed_token_ids": allowed, "temperature": 0}, dict(allowed_token_ids=tuple(allowed), temperature=0.0)),
        ({"bad_words": words, "temperature": 0},
         dict(bad_words=tuple(s for w in words for s in bad_word_sequences(w, TOK)), temperature=0.0)),
    ]
    for request, kw in cases:
        out = post_json(r.http_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                         "ignore_eos": True, **request})
        ref = generate_full(model.model, KVPool(model.config, 16, 16), [ids],
                            [SamplingParams(max_tokens=16, ignore_eos=True, **kw)])[0]
        assert out["choices"][0]["text"] == TOK.decode(ref.token_ids), request
    plain = post_json(r.http_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                       "ignore_eos": True, "temperature": 0})
    masked = post_json(r.http_url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                        "ignore_eos": True, "temperature": 0,
                                                        "allowed_token_ids": allowed, "logprobs": 0})
    assert masked["choices"][0]["text"] != plain["choices"][0]["text"]
    assert all(TOK.encode(t, add_special_tokens=False)[0] in allowed
               for t in masked["choices"][0]["logprobs"]["tokens"])
    m.assert_invariants()
