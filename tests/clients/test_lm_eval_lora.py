"""lm-evaluation-harness against a LoRA adapter served by the mesh (`model` is the adapter's name,
as with vLLM's --lora-modules): `generate_until` through `local-completions` and
`local-chat-completions` answers what PEFT's own model answers greedily with the same adapter,
cut at the stop strings the client sent. The adapter is made and saved by PEFT; the mesh is its
own (router and both workers with --enable-lora). `make clients-test` only (marked long): the
base model's clients run in `make test`'s short form already.
"""

from __future__ import annotations

import json

import pytest

from tests.clients.clients_venv import require_clients_venv
from tests.clients.lm_eval_client import chat_run, completions_run, run_lm_eval, task_docs
from tests.clients.reference import chat_prompt_ids, completion_prompt_ids, greedy_text
from tests.integration.mesh import mesh_with_router

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(600)]
peft = pytest.importorskip("peft")

TASK = "pdmesh_greedy"
ADAPTER = "pdmesh-sql"


def peft_greedy_text(path: str, ids: list[int], max_new_tokens: int, until: list[str]) -> str:
    """PEFT's model with the adapter, greedy, stopping at an eos id, cut before the first stop string."""
    import torch
    import transformers

    from services.common.tokenizer import BUILTIN_MODEL_DIR, load_tokenizer

    tok = load_tokenizer(None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, path).eval()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new_tokens:
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token in tok.eos_token_ids:
                break
    text = tok.decode(out, skip_special_tokens=True)
    cuts = [text.index(s) for s in until if s and s in text]
    return text[: min(cuts)] if cuts else text


@pytest.fixture(scope="module")
def lora_router(tmp_path_factory):
    require_clients_venv()
    from tests.unit.test_lora_engine import make_adapter

    root = tmp_path_factory.mktemp("clients-lora")
    path = make_adapter(root / "sql", 11)
    flags = ("--enable-lora", "--lora-modules", f"{ADAPTER}={path}")
    with mesh_with_router(root, prefill_flags=flags, decode_flags=flags,
                          router_flags=(*flags, "--request-timeout", "120")) as (m, _, _, router):
        yield m, router, path


def test_lm_eval_on_an_adapter_answers_as_peft(lora_router, tmp_path):
    m, router, path = lora_router
    docs = task_docs(TASK)
    runs = [completions_run(router, [TASK], batch_size=4), chat_run(router, [TASK])]
    for run in runs:  # the same clients, their model the adapter's name
        run["model_args"] = run["model_args"].replace("model=pdmesh-tiny,", f"model={ADAPTER},", 1)
        assert f"model={ADAPTER}," in run["model_args"]
    outputs = run_lm_eval(runs, tmp_path)
    differs = 0
    for kind, out in zip(("completions", "chat"), outputs, strict=True):
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        assert len(samples) == len(docs), kind
        for s in samples:
            context, gen_kwargs = s["arguments"][0]
            ids = completion_prompt_ids(context) if kind == "completions" else chat_prompt_ids(json.loads(context[0]))
            want = peft_greedy_text(path, ids, gen_kwargs["max_gen_toks"], gen_kwargs["until"])
            got = s["resps"][0][0]
            print(f"{kind} {s['doc']['prompt']!r} -> {got!r}")
            assert got == want, (kind, s["doc_id"], got, want)
            differs += got != greedy_text(ids, gen_kwargs["max_gen_toks"], gen_kwargs["until"])
    assert differs, "every answer equals the base model's: the adapter changed nothing visible"
    m.assert_invariants()
