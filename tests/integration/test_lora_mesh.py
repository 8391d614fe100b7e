"""LoRA adapters (vLLM's --enable-lora --lora-modules) through router + prefill + decode processes,
with adapters PEFT itself saved and answers compared with PEFT's own greedy generation.

- /v1/models lists the adapters with the base model as parent; the openai SDK's completions and
  chat with `model` an adapter equal PEFT's tokens; the response names the adapter.
- The prefix cache keeps each adapter's pages apart: one long prompt sent for the base model,
  then for each adapter, gives each its own answer (no cache hit across them), and a repeat of the
  same adapter hits.
- A follow-up turn that decode computes itself (conditional disaggregation: it holds the first
  turn's KV) still applies the adapter.
- An adapter the workers do not serve is a 400 naming it; an unknown model a 404 listing the
  adapters. Invariants after each scenario.
"""

from __future__ import annotations

import json

import httpx
import pytest

from services.common.tokenizer import load_tokenizer
from tests.integration.http_client import post_json
from tests.integration.mesh import mesh_with_router
from tests.unit.test_lora_engine import make_adapter, peft_greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
pytest.importorskip("peft")

MODEL = "pdmesh-tiny"
TOK = load_tokenizer(None)
LONG = ("The quick brown fox jumps over the lazy dog while the function returns the value of the "
        "argument and the module provides a list of files to open. ") * 3


@pytest.fixture(scope="module")
def lora_mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    adapters = {"sql": make_adapter(root / "sql", 1),
                "poet": make_adapter(root / "poet", 2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"))}
    flags = ("--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))
    with mesh_with_router(root, prefill_flags=flags, decode_flags=flags, router_flags=flags) as (m, (p,), (d,), r):
        yield m, p, d, r, adapters


def complete(r, model: str, ids: list[int], n: int = 10) -> dict:
    return post_json(r.http_url, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": n,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True})


def test_adapters_answer_as_peft_does(lora_mesh):
    openai = pytest.importorskip("openai")
    m, p, d, r, adapters = lora_mesh
    client = openai.OpenAI(base_url=f"{r.http_url}/v1", api_key="x")
    cards = {c.id: c for c in client.models.list().data}
    assert set(cards) >= {MODEL, "sql", "poet"}
    assert cards["sql"].parent == MODEL and cards["sql"].root == adapters["sql"]
    assert client.models.retrieve("poet").parent == MODEL
    ids = TOK.encode("Return the value of")
    base = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    for name, path in adapters.items():
        out = client.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        want = peft_greedy(path, ids, 10)
        assert out.model == name
        assert out.choices[0].model_extra["token_ids"] == want, name
        assert want != base.choices[0].model_extra["token_ids"]
    chat = [{"role": "user", "content": "Hello!"}]
    reply = client.chat.completions.create(model="sql", messages=chat, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = TOK.encode_chat(chat)
    assert reply.model == "sql"
    assert reply.choices[0].model_extra["token_ids"] == peft_greedy(adapters["sql"], prompt_ids, 8)
    m.assert_invariants()


def test_the_prefix_cache_keeps_adapters_apart(lora_mesh):
    m, p, d, r, adapters = lora_mesh
    ids = TOK.encode(LONG)
    assert len(ids) > 64  # several full pages
    first = complete(r, MODEL, ids)
    for name, path in adapters.items():
        out = complete(r, name, ids)
        assert out["choices"][0]["token_ids"] == peft_greedy(path, ids, 10), name
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, name  # not the base model's pages
    again = complete(r, "sql", ids)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert again["choices"][0]["token_ids"] == peft_greedy(adapters["sql"], ids, 10)
    assert complete(r, MODEL, ids)["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    m.assert_invariants()


def test_a_follow_up_computed_on_decode_keeps_the_adapter(lora_mesh):
    m, p, d, r, adapters = lora_mesh
    ids = TOK.encode("A list of files to open and the value of the argument")
    turn1 = complete(r, "poet", ids, 12)["choices"][0]["token_ids"]
    follow = ids + turn1 + TOK.encode(" and then", add_special_tokens=False)
    before = r.metrics().get("pdmesh:router_local_prefill_requests_total", 0)
    out = complete(r, "poet", follow, 8)
    assert out["choices"][0]["token_ids"] == peft_greedy(adapters["poet"], follow, 8)
    assert r.metrics()["pdmesh:router_local_prefill_requests_total"] == before + 1  # decode computed the tail
    m.assert_invariants()


def test_unknown_adapters_are_refused(lora_mesh, tmp_path):
    m, p, d, r, adapters = lora_mesh
    resp = httpx.post(f"{r.http_url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 404 and "'sql'" in resp.json()["error"]["message"]
    # a router that lists an adapter its workers were not started with: their refusal reaches the client
    other = m.start_router([p], [d], "--enable-lora", "--lora-modules", f"extra={adapters['sql']}")
    resp = httpx.post(f"{other.http_url}/v1/completions", json={"model": "extra", "prompt": "x", "max_tokens": 2},
                      timeout=30)
    assert resp.status_code == 400 and "extra" in resp.json()["error"]["message"], resp.text
    m.assert_invariants()


def _served(proc, stub_class) -> set[str]:
    """The adapters a worker reports in Load (what the router's probe reads)."""
    import asyncio

    import grpc

    from services.common.generated.pdmesh.v1 import worker_pb2 as wpb
    from services.common.mesh_protocol import MIN_PEER_VERSION, PROTOCOL_VERSION

    async def load():
        async with grpc.aio.insecure_channel(proc.grpc_addr) as channel:
            return await stub_class(channel).Load(
                wpb.LoadRequest(protocol_version=PROTOCOL_VERSION, min_protocol_version=MIN_PEER_VERSION), timeout=10)

    return set(asyncio.run(load()).lora_adapters)


def test_runtime_loading_unloading_and_a_restarted_worker(lora_mesh, tmp_path):
    """Last in the module: it restarts the decode worker."""
    import threading

    from services.common.generated.pdmesh.v1 import worker_pb2_grpc as wpb_grpc
    from services.launch.probes import wait_for

    m, p, d, r, adapters = lora_mesh
    static = ("--enable-lora", "--lora-modules", *(f"{n}={path}" for n, path in adapters.items()))
    off = httpx.post(f"{r.http_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert off.status_code == 400 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]
    rr = m.start_router([p], [d], *static, "--allow-runtime-lora-updating", "--health-check-interval", "0.2")
    late = make_adapter(tmp_path / "late", 5, targets=("q_proj", "up_proj"))
    ids = TOK.encode("Open the file and")

    resp = httpx.post(f"{rr.http_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": late},
                      timeout=60)
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in {c["id"] for c in httpx.get(f"{rr.http_url}/v1/models").json()["data"]}

    def schema_models():
        schema = httpx.get(f"{rr.http_url}/openapi.json").json()
        return set(schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"])

    assert {"late", "sql", "poet", MODEL} <= schema_models()
    assert complete(rr, "late", ids)["choices"][0]["token_ids"] == peft_greedy(late, ids, 10)
    again = httpx.post(f"{rr.http_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": late})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{rr.http_url}/v1/load_lora_adapter",
                     json={"lora_name": "broken", "lora_path": str(tmp_path / "nowhere")}, timeout=60)
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"], bad.text
    assert {"broken"}.isdisjoint(_served(p, wpb_grpc.PrefillStub) | _served(d, wpb_grpc.DecodeStub))
    missing = httpx.post(f"{rr.http_url}/v1/load_lora_adapter", json={"lora_name": "y"})
    assert missing.status_code == 400
    inplace = httpx.post(f"{rr.http_url}/v1/load_lora_adapter",
                         json={"lora_name": "late", "lora_path": late, "load_inplace": True})
    assert inplace.status_code == 400 and inplace.json()["error"]["param"] == "load_inplace"

    # unloaded mid-stream: the running request keeps its weights to the end, new ones are a 404
    long = {"model": "late", "prompt": ids, "max_tokens": 160, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    got: list[int] = []
    started = threading.Event()

    def read():  # event by event, as they arrive
        with httpx.stream("POST", f"{rr.http_url}/v1/completions", json={**long, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got.extend(c.get("token_ids") or [])
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    unload = httpx.post(f"{rr.http_url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30)
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'late' removed successfully."
    assert reader.is_alive()  # unloaded while the request still ran
    gone = httpx.post(f"{rr.http_url}/v1/completions", json={**long, "max_tokens": 2})
    assert gone.status_code == 404
    reader.join(120)
    assert got == peft_greedy(late, ids, 160)
    wait_for(lambda: "late" not in _served(d, wpb_grpc.DecodeStub), 20, "decode drops the unloaded adapter")
    assert httpx.post(f"{rr.http_url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    assert "late" not in schema_models()

    # a restarted decode lacks what was loaded at runtime: the router brings it there
    assert httpx.post(f"{rr.http_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": late},
                      timeout=60).status_code == 200
    d2 = m.restart(d)
    wait_for(lambda: "late" in _served(d2, wpb_grpc.DecodeStub), 30, "the restarted decode serves 'late' again")
    assert complete(rr, "late", ids)["choices"][0]["token_ids"] == peft_greedy(late, ids, 10)
    m.assert_invariants()
