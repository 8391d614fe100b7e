"""A real Hugging Face folder (a transformers-built Llama with an 8,192-token context) served
with --max-model-len 2048 and a KV budget in bytes, on real prefill + decode processes:

- both workers log the pool's token capacity at start (`kv cache sized`) and report it, with
  their --max-model-len, in the router's /health;
- a request longer than 2,048 tokens is a clear 400 from the router;
- a chat request without max_tokens asks for no more than the decode pool holds (it runs to
  `length` at exactly the pool's capacity, not at the context length);
- the model's generation_config.json sampling defaults apply (and a request overrides them).
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from services.common.tokenizer import BUILTIN_MODEL_DIR, load_tokenizer
from services.engine.kv_budget import page_bytes
from services.engine.model_config import ModelConfig
from tests.integration.http_client import post_json
from tests.integration.mesh import mesh_with_router, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PAGES = 48  # 768 tokens of KV per worker
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from services.fakes.hf_checkpoints import save_tiny_llama

    folder = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama-8k", vocab_size=2048,
                             max_positions=8192)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUILTIN_MODEL_DIR / name, folder / name)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    import torch

    budget = PAGES * page_bytes(cfg, 16, torch.float32)
    flags = ("--model", str(folder), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(budget))
    router_flags = ("--model", str(folder), "--max-model-len", str(MAX_MODEL_LEN), "--request-timeout", "120")
    with mesh_with_router(tmp_path_factory.mktemp("capacity"), 1, 1, flags, flags, router_flags) as (m, (p,), (d,), r):
        # the decode's capacity reaches the router with its first Load report after a probe
        wait_for(lambda: any(w["kv_capacity_tokens"] for w in r.health()["decode"].values()), 20,
                 "the router to learn the decode pool's capacity")
        yield m, p, d, r, folder


def _log_lines(proc, event: str) -> list[dict]:
    out = []
    for line in proc.log().splitlines():
        if event in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_workers_log_their_token_capacity(served):
    m, p, d, r, folder = served
    for worker in (p, d):
        sized = _log_lines(worker, "kv cache sized")
        assert sized, worker.log()[-2000:]
        assert sized[0]["tokens"] == PAGES * 16 and sized[0]["source"] == "kv-cache-memory-bytes"
        assert sized[0]["max_model_len"] == MAX_MODEL_LEN
    # both roles report what they hold in /health (the prefill's Load report reaches the router
    # with its first probe, like the decode's)
    wait_for(lambda: all(w["kv_capacity_tokens"] for role in ("prefill", "decode") for w in r.health()[role].values()),
             20, "the router to learn both pools' capacity")
    for role in ("prefill", "decode"):
        workers = list(r.health()[role].values())
        assert workers[0]["kv_capacity_tokens"] == PAGES * 16 and workers[0]["max_model_len"] == MAX_MODEL_LEN, role


def test_a_request_over_the_length_is_a_400(served):
    m, p, d, r, folder = served
    models = httpx.get(r.http_url + "/v1/models").json()["data"]
    assert models[0]["max_model_len"] == MAX_MODEL_LEN
    name = models[0]["id"]
    resp = httpx.post(r.http_url + "/v1/completions", json={"model": name, "prompt": [5] * 2000, "max_tokens": 100})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    resp = httpx.post(r.http_url + "/v1/completions", json={"model": name, "prompt": [5] * 2100})
    assert resp.status_code == 400 and "2048" in resp.json()["error"]["message"]
    m.assert_invariants()


def test_no_max_tokens_never_asks_more_than_the_pool_holds(served):
    m, p, d, r, folder = served
    name = httpx.get(r.http_url + "/v1/models").json()["data"][0]["id"]
    tok = load_tokenizer(str(folder))
    messages = [{"role": "user", "content": "Count to a thousand."}]
    prompt_len = len(tok.encode_chat(messages))
    out = post_json(r.http_url, "/v1/chat/completions", {"model": name, "messages": messages, "ignore_eos": True},
                    timeout=240)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == PAGES * 16 - prompt_len
    m.assert_invariants()


def test_generation_config_defaults_apply_and_yield_to_the_request(served):
    m, p, d, r, folder = served
    name = httpx.get(r.http_url + "/v1/models").json()["data"][0]["id"]
    body = {"model": name, "prompt": "The", "max_tokens": 12, "ignore_eos": True}
    greedy = [post_json(r.http_url, "/v1/completions", body)["choices"][0]["text"] for _ in range(2)]
    assert greedy[0] == greedy[1]  # temperature 0 from generation_config.json
    explicit = post_json(r.http_url, "/v1/completions", {**body, "temperature": 0})["choices"][0]["text"]
    assert explicit == greedy[0]
    hot = {post_json(r.http_url, "/v1/completions", {**body, "temperature": 2.0, "seed": s})["choices"][0]["text"]
           for s in range(4)}
    assert len(hot) > 1  # the request's temperature wins
    m.assert_invariants()
