"""Prompt logprobs through the real mesh (router, prefill, decode; real gRPC, HTTP and NIXL), against
transformers on the built-in checkpoint (models/pdmesh-tiny, fp32 on CPU), per token within 1e-3:

- lm-evaluation-harness's log-likelihood request as `local-completions` sends it (a batch of
  token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0, a seed) returns what its
  parse_logprobs reads: token_logprobs / top_logprobs over the prompt, the first null;
- prompts longer than the workers' chunk (computed in several chunks), n > 1, streamed and not,
  max_tokens 0 with echo (the prompt alone), vLLM's prompt_logprobs on completions and chat;
- with the prefix cache warm (the same prompt served before) the logprobs still equal the
  reference, because such a request recomputes its prompt (prefill's computed-token counter grows
  by the whole prompt);
- the colocated path (decode computes the prompt) gives the same.

Every scenario ends with mesh.assert_invariants().
"""

from __future__ import annotations

import math
import random

import httpx
import pytest
import torch

from services.common.tokenizer import load_tokenizer
from tests.integration.http_client import post_json, stream_events
from tests.integration.mesh import Mesh

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "pdmesh-tiny"
FOLDER = "models/pdmesh-tiny"
CHUNK = 32  # the workers' --chunked-prefill-size: the longer prompts below take several chunks
TOL = 1e-3
TOK = load_tokenizer(None)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("prompt-logprobs"))
    try:
        (p,), (d,) = m.start_workers(1, 1, ("--chunked-prefill-size", str(CHUNK)),
                                     ("--chunked-prefill-size", str(CHUNK)))
        pd = m.start_router([p], [d], "--request-timeout", "60")
        colo = m.start_router([], [d], "--request-timeout", "60", "--mode", "colocated")
        yield m, p, d, pd, colo
    finally:
        m.close()


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax at every position but the last: row i predicts prompt token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


def own(ref: torch.Tensor, ids: list[int]) -> list[float]:
    return ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs computes."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), greedy


def test_lm_eval_loglikelihood_request(mesh, hf):
    m, p, d, pd, _ = mesh
    # context + continuation as lm-eval sends them: token ids, batched, echo, logprobs 1, max_tokens 1
    ctx = prompts(1, [70, 20, 45])
    conts = prompts(2, [5, 3, 9])
    batch = [c + x for c, x in zip(ctx, conts, strict=True)]
    out = post_json(pd.http_url, "/v1/completions", {
        "model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(batch)
    for choice, ids, c in zip(choices, batch, ctx, strict=True):
        ref = reference(hf, ids)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert close(lp["token_logprobs"][1 : len(ids)], own(ref, ids))
        assert choice["text"].startswith(TOK.decode(ids, skip_special_tokens=False))
        offsets = lp["text_offset"]  # where each token's text starts in `text`
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[len(ids)] == len(TOK.decode(ids, skip_special_tokens=False))
        total, greedy = lm_eval_parse(choice, len(c))
        tail = own(ref, ids)[len(c) - 1 :]
        assert abs(total - sum(tail)) < TOL * len(tail)
        want_greedy = all(ref[i - 1].argmax().item() == ids[i] for i in range(len(c), len(ids)))
        assert greedy == want_greedy
        # logprobs 1: the most likely token, plus the prompt's own where it is not that one
        for i in range(1, len(ids)):
            top = lp["top_logprobs"][i]
            assert 1 <= len(top) <= 2 and abs(max(top.values()) - ref[i - 1].max().item()) < TOL
    assert out["usage"]["prompt_tokens"] == sum(len(b) for b in batch)
    m.assert_invariants()


def test_echo_logprobs_streamed_n2_and_max_tokens_zero(mesh, hf):
    m, p, d, pd, _ = mesh
    (ids,) = prompts(3, [80])
    ref_own = own(reference(hf, ids), ids)
    body = {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 3, "logprobs": 2, "echo": True,
            "n": 2, "ignore_eos": True}
    whole = post_json(pd.http_url, "/v1/completions", body)
    events = stream_events(pd.http_url, "/v1/completions", {**body, "stream": True})
    for choice in whole["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3
        assert close(lp["token_logprobs"][1 : len(ids)], ref_own)
        streamed = [e["choices"][0] for e in events if e.get("choices") and e["choices"][0]["index"] == choice["index"]]
        tokens = [t for c in streamed if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        assert tokens[0] is None and close(tokens[1:], lp["token_logprobs"][1:])
        assert "".join(c["text"] for c in streamed) == choice["text"]
    # max_tokens 0 with echo: the prompt alone, its logprobs, finish_reason length
    alone = post_json(pd.http_url, "/v1/completions", {**body, "max_tokens": 0, "n": 1})["choices"][0]
    assert alone["text"] == TOK.decode(ids, skip_special_tokens=False) and alone["finish_reason"] == "length"
    assert len(alone["logprobs"]["tokens"]) == len(ids)
    assert close(alone["logprobs"]["token_logprobs"][1:], ref_own)
    m.assert_invariants()


def test_vllm_prompt_logprobs_completions_and_chat(mesh, hf):
    m, p, d, pd, _ = mesh
    (ids,) = prompts(4, [50])
    ref = reference(hf, ids)
    out = post_json(pd.http_url, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                     "prompt_logprobs": 3, "n": 2, "temperature": 0})
    for choice in out["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i]
            mine = entry[str(ids[i])]
            assert abs(mine["logprob"] - ref[i - 1, ids[i]].item()) < TOL
            assert mine["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
            top3 = {str(t) for t in torch.topk(ref[i - 1], 3).indices.tolist()}
            assert top3 <= set(entry) and len(entry) <= 4
            assert all(v["decoded_token"] is not None and not math.isnan(v["logprob"]) for v in entry.values())
    chat = post_json(pd.http_url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "What does os.path.join do?"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in plp[1:])  # 0 alternatives: the prompt's own token only
    # a one-token prompt: nothing has context, and that is still an answer
    one = post_json(pd.http_url, "/v1/completions", {"model": MODEL, "prompt": [ids[0]], "max_tokens": 1,
                                                     "prompt_logprobs": 0, "echo": True, "logprobs": 0})
    assert one["choices"][0]["prompt_logprobs"] == [None]
    assert one["choices"][0]["logprobs"]["token_logprobs"][0] is None
    m.assert_invariants()


def test_prefix_cache_warm_still_gives_every_prompt_token(mesh, hf):
    m, p, d, pd, _ = mesh
    (ids,) = prompts(5, [96])  # six full pages: cacheable
    ref_own = own(reference(hf, ids), ids)
    post_json(pd.http_url, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1})  # warms it
    before = p.metrics()
    first = post_json(pd.http_url, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                       "echo": True, "logprobs": 0})
    mid = p.metrics()
    second = post_json(pd.http_url, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                        "echo": True, "logprobs": 0})
    after = p.metrics()
    for out in (first, second):
        assert close(out["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], ref_own)
    # recomputed, not read from the cache: every prompt token went through a forward both times
    assert mid["pdmesh:prompt_tokens_total"] - before["pdmesh:prompt_tokens_total"] == len(ids)
    assert after["pdmesh:prompt_tokens_total"] - mid["pdmesh:prompt_tokens_total"] == len(ids)
    m.assert_invariants()


def test_colocated_decode_computes_them_too(mesh, hf):
    m, p, d, pd, colo = mesh
    (ids,) = prompts(6, [75])
    ref_own = own(reference(hf, ids), ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    for _ in range(2):  # the second time decode's cache holds the prompt: recomputed all the same
        out = post_json(colo.http_url, "/v1/completions", body)
        assert close(out["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)], ref_own)
    m.assert_invariants()


def test_bad_input_is_an_openai_400(mesh):
    m, p, d, pd, _ = mesh
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True},
                  {"max_tokens": 0}):
        r = httpx.post(pd.http_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **extra}, timeout=10)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] in ("prompt_logprobs", "max_tokens")
    m.assert_invariants()
