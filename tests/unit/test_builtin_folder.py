"""The default model is the shipped Hugging Face folder models/pdmesh-tiny, loaded by the same code
as any checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from services.common.tokenizer import BUILTIN_MODEL_DIR, HuggingFaceTokenizer, load_tokenizer
from services.engine.loader import load_model

FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "chat_template.jinja", "README.md")
SAMPLES = ("Return the number of items in the queue.", "Hi! Ça va? 🤖", "  two  spaces\n\tand a tab", "")


def test_shipped_folder_is_an_ordinary_small_hf_folder():
    for name in FOLDER_FILES:
        assert (BUILTIN_MODEL_DIR / name).is_file(), name
    size = sum(p.stat().st_size for p in BUILTIN_MODEL_DIR.iterdir())
    assert size < 20 * 2**20
    with safe_open(str(BUILTIN_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    cfg = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["vocab_size"] >= 256 + 7  # test prompts of random ids below 256 are ordinary tokens


def test_default_model_is_the_shipped_folder_upcast_on_cpu():
    default, explicit = load_model(None), load_model(str(BUILTIN_MODEL_DIR))
    assert load_model("builtin").path == default.path == str(BUILTIN_MODEL_DIR)
    assert default.config.name == "pdmesh-tiny"  # the served model name, and the metrics label
    assert default.dtype == torch.float32
    for (na, pa), (nb, pb) in zip(default.model.state_dict().items(), explicit.model.state_dict().items(),
                                  strict=True):
        assert na == nb and torch.equal(pa, pb)
    n = sum(p.numel() for p in default.model.parameters())
    assert 500_000 < n < 10_000_000
    tok = load_tokenizer(None)
    assert set(default.config.eos_token_ids) == set(tok.eos_token_ids) == {
        tok.backend.token_to_id("<|eos|>"), tok.backend.token_to_id("<|end|>")}


def test_default_tokenizer_equals_transformers():
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(None)
    assert isinstance(ours, HuggingFaceTokenizer) and load_tokenizer("builtin").vocab_size == ours.vocab_size
    ref = transformers.AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    for text in SAMPLES:
        assert ours.encode(text) == ref(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "Hello!"}]
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, add_generation_prompt=True,
                                                                     tokenize=False)
    assert ours.apply_chat_template(chat) == "<|bos|><|user|>Hello!<|end|><|assistant|>"
    assert [ours.is_special(i) for i in range(256)] == [False] * 256


def test_shipped_chat_template_is_the_builtin_one_and_transformers_renders_tool_turns_alike():
    from services.common.builtin_tokenizer import chat_template

    assert (BUILTIN_MODEL_DIR / "chat_template.jinja").read_text(encoding="utf-8") == chat_template("the pdmesh-tiny")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    ours = load_tokenizer(None).apply_chat_template(chat)
    assert ours == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert '<|assistant|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|end|>' in ours
