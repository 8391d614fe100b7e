"""vLLM's request features through the router on real prefill + decode processes.

- Batched prompts on /v1/completions: 8 prompts x n = 2 give 16 choices indexed prompt i x 2 + j,
  each equal to the single request for prompt i with seed + j (greedy and seeded), streamed too.
- min_p, allowed_token_ids and bad_words reach both workers (prefill samples the first token,
  decode the rest): the output equals single-process generation with the same parameters.
One mesh for the module; each scenario ends with the invariants.
"""

from __future__ import annotations

import time

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


def _beam_reference(prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float = 1.0):
    """vLLM's beam search over transformers' logprobs of the built-in model, every step run
    (tests/unit/test_beam_search.reference): [(generated ids, sum of logprobs, ended by a stop)]."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from services.common.tokenizer import BUILTIN_MODEL_DIR
    from tests.unit.test_beam_search import reference

    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32).eval()

    def top(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + list(prefix)])).logits[0, -1].float()
        values, ids = torch.topk(torch.log_softmax(logits, -1), 2 * width)
        return list(zip(ids.tolist(), values.tolist(), strict=True))

    return reference(top, width, max_tokens, set(TOK.eos_token_ids), 0, length_penalty)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beam_search_finds_the_best_beams(router, length_penalty):
    m, p, d, r = router
    prompt = "The quick brown fox"
    ids = TOK.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "n": 3, "max_tokens": 6, "use_beam_search": True,
            "length_penalty": length_penalty, "return_token_ids": True, "logprobs": 2, "temperature": 0}
    out = post_json(r.http_url, "/v1/completions", body, timeout=120)
    want = _beam_reference(ids, 3, 6, length_penalty)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [list(w[0]) for w in want]
    for c, (tokens, cum, stopped) in zip(choices, want, strict=True):
        assert c["finish_reason"] == ("stop" if stopped else "length")
        assert c["text"] == TOK.decode(list(tokens))
        assert sum(c["logprobs"]["token_logprobs"]) == pytest.approx(cum, abs=1e-3)
        assert all(len(alt) == 2 for alt in c["logprobs"]["top_logprobs"])
    assert out["usage"]["completion_tokens"] == sum(len(w[0]) for w in want)
    assert out["usage"]["prompt_tokens"] == len(ids)
    m.assert_invariants()


def test_beam_search_streams_batches_and_chats_as_it_answers(router):
    m, p, d, r = router
    body = {"model": MODEL, "prompt": PROMPTS[:2], "n": 2, "max_tokens": 5, "use_beam_search": True}
    out = post_json(r.http_url, "/v1/completions", body, timeout=120)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for i, prompt in enumerate(PROMPTS[:2]):
        single = post_json(r.http_url, "/v1/completions", {**body, "prompt": prompt}, timeout=120)
        assert [c["text"] for c in choices[2 * i: 2 * i + 2]] == [c["text"] for c in single["choices"]]
    streamed = [""] * 4
    for ev in stream_events(r.http_url, "/v1/completions", {**body, "stream": True}, timeout=120):
        for c in ev["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == [c["text"] for c in choices]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "n": 2, "max_tokens": 6,
            "use_beam_search": True}
    reply = post_json(r.http_url, "/v1/chat/completions", chat, timeout=120)
    texts = [c["message"]["content"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    streamed = ["", ""]
    for ev in stream_events(r.http_url, "/v1/chat/completions", {**chat, "stream": True}, timeout=120):
        for c in ev["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert streamed == texts and len(set(texts)) == 2
    m.assert_invariants()


@pytest.mark.parametrize("extra,param", [({"temperature": 0.5}, "temperature"), ({"n": 11}, "n"),
                                         ({"response_format": {"type": "json_object"}}, "response_format"),
                                         ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty")])
def test_beam_search_refuses_what_it_cannot_honour(router, extra, param):
    m, p, d, r = router
    import httpx

    body = {"model": MODEL, "prompt": "The", "max_tokens": 4, "use_beam_search": True, **extra}
    resp = httpx.post(f"{r.http_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    m.assert_invariants()


def test_a_client_leaving_mid_search_ends_every_step(router):
    m, p, d, r = router
    import httpx

    from services.launch.probes import wait_for

    body = {"model": MODEL, "prompt": "Once upon a time", "n": 4, "max_tokens": 400, "ignore_eos": True,
            "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{r.http_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: r.metrics().get("pdmesh:router_num_running_reqs") == 0, 20, "the router's request ended")
    m.assert_invariants()
    steps = r.metrics()["pdmesh:router_local_prefill_requests_total"]
    assert r.metrics()["pdmesh:router_num_aborted_requests_total"] >= 1
    time.sleep(0.5)  # no condition to wait on: this checks that nothing more happens
    assert r.metrics()["pdmesh:router_local_prefill_requests_total"] == steps
