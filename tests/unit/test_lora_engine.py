"""LoRA adapters in the engine (services/engine/lora.py) against PEFT itself: an adapter saved by
PEFT's save_pretrained for the built-in model gives, through our loader, runner and paged KV cache,
the greedy tokens PEFT's model generates; requests of two adapters and of the base model in one
batch each get what they get alone; what the engine cannot compute is refused at load."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from services.common.lora_modules import LoraError, LoraModule, parse_lora_modules  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.tokenizer import BUILTIN_MODEL_DIR, load_tokenizer  # noqa: E402
from services.engine.kv_pool import KVPool  # noqa: E402
from services.engine.loader import load_model  # noqa: E402
from services.engine.local_generate import generate_full  # noqa: E402
from services.engine.lora import LoraAdapters  # noqa: E402

TOK = load_tokenizer(None)
PROMPTS = ["The quick brown fox", "def main():", "Return the value of"]


def make_adapter(folder: pathlib.Path, seed: int, targets=("q_proj", "v_proj", "down_proj"), **config) -> str:
    """A PEFT LoRA adapter of the built-in model with random (non-zero) B, saved as PEFT saves it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), lora_dropout=0.0, **config)
    model = peft.get_peft_model(hf, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.2))
    model.save_pretrained(str(folder))
    return str(folder)


def peft_greedy(path: str, prompt_ids: list[int], n: int) -> list[int]:
    """PEFT's model, greedy, n tokens whatever they are (eos too, as ignore_eos)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_DIR, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, path).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"a": make_adapter(root / "a", 1),
            "b": make_adapter(root / "b", 2, targets=("k_proj", "o_proj", "gate_proj", "up_proj"), use_rslora=True)}


def run(loaded, adapters: LoraAdapters, prompts: list[list[int]], names: list[str], n: int = 12):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora_name=name) for name in names]
    return [g.token_ids for g in generate_full(loaded.model, KVPool(loaded.config, 64, 16), prompts, params,
                                               chunk_budget=7, adapters=adapters)]


def test_greedy_tokens_equal_pefts(adapters):
    loaded = load_model(None)
    served = LoraAdapters(loaded.model, [LoraModule(k, v) for k, v in adapters.items()])
    ids = [TOK.encode(p) for p in PROMPTS]
    for name, path in adapters.items():
        got = run(loaded, served, ids, [name] * len(ids))  # chunk_budget 7: chunked prefill, then decode steps
        assert got == [peft_greedy(path, i, 12) for i in ids], name
    base = run(loaded, served, ids, [""] * len(ids))
    assert base != got  # the adapters change the output
    plain = load_model(None)  # a model with no adapters attached gives the base tokens
    assert run(plain, None, ids, [""] * len(ids)) == base


def test_adapters_and_the_base_model_share_a_batch(adapters):
    loaded = load_model(None)
    served = LoraAdapters(loaded.model, [LoraModule(k, v) for k, v in adapters.items()])
    ids = [TOK.encode(p) for p in PROMPTS]
    names = ["a", "", "b"]
    mixed = run(loaded, served, ids, names)
    alone = [run(loaded, served, [i], [name])[0] for i, name in zip(ids, names, strict=True)]
    assert mixed == alone


def test_what_the_engine_cannot_compute_is_refused(tmp_path, adapters):
    loaded = load_model(None)
    dora = make_adapter(tmp_path / "dora", 3, use_dora=True)
    with pytest.raises(LoraError, match="use_dora"):
        LoraAdapters(loaded.model, [LoraModule("d", dora)])
    head = make_adapter(tmp_path / "head", 4, targets=("lm_head",))
    with pytest.raises(LoraError, match="lm_head"):
        LoraAdapters(loaded.model, [LoraModule("h", head)])
    with pytest.raises(LoraError, match="max-lora-rank"):
        LoraAdapters(loaded.model, [LoraModule("a", adapters["a"])], max_rank=4)
    with pytest.raises(LoraError, match="adapter_config.json"):
        LoraAdapters(loaded.model, [LoraModule("x", str(tmp_path))])
    # an adapter of another shape (a wider model) names the layer
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    from safetensors.torch import save_file
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 999),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 2)},
              str(other / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="q_proj"):
        LoraAdapters(loaded.model, [LoraModule("o", str(other))])
    # nothing of a refused adapter was attached
    assert all(getattr(m, "lora", None) is None for m in loaded.model.modules())


def test_the_flag_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        LoraModule("a", "/x"), LoraModule("b", "/y")]
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"], ['{"name": 1}'], ["{bad"]):
        with pytest.raises(LoraError):
            parse_lora_modules(bad)
