"""LoRA adapters on the router's side: the flag's names as served models, the adapter on the wire,
the prefix keys the router computes equal to the workers' and apart per adapter, the start-up
refusals."""

from __future__ import annotations

import pytest

from services.common.tokenizer import load_tokenizer
from services.engine.page_allocator import PageAllocator
from services.engine.prefix_cache import PrefixCache, chain_root
from services.router.errors import APIError
from services.router.model_controls import lora_adapters
from services.router.orchestrator import sampling_params
from services.router.prefix_index import RequestKeys
from services.router.protocol import ModelInfo, parse_chat, parse_completion

TOK = load_tokenizer("builtin")
INFO = ModelInfo(name="base", tokenizer=TOK, context_length=256, aliases=frozenset({"builtin"}),
                 adapters={"sql": "/a/sql", "poet": "/a/poet"})


def test_an_adapters_name_is_a_served_model_and_travels_to_the_workers():
    spec = parse_completion({"model": "sql", "prompt": "hello", "max_tokens": 2}, INFO)
    assert spec.model == "sql" and spec.lora_name == "sql"
    assert sampling_params(spec, TOK.eos_token_ids).lora_name == "sql"
    chat = parse_chat({"model": "poet", "messages": [{"role": "user", "content": "hi"}]}, INFO)
    assert chat.lora_name == "poet" and chat.model == "poet"
    for model in ("base", "builtin", None):
        spec = parse_completion({"model": model, "prompt": "hello", "max_tokens": 2}, INFO)
        assert spec.lora_name == "" and spec.model == "base"
    batch = parse_completion({"model": "sql", "prompt": ["a", "b"], "max_tokens": 2}, INFO)
    assert all(p.lora_name == "sql" for p in batch.prompts)


def test_an_unknown_model_lists_the_adapters():
    with pytest.raises(APIError) as err:
        parse_completion({"model": "nope", "prompt": "x"}, INFO)
    assert err.value.status == 404 and "'sql'" in err.value.message and "'poet'" in err.value.message


def test_prefix_keys_are_apart_per_adapter_and_equal_the_workers():
    ids = list(range(40))
    cache = PrefixCache(PageAllocator(8), 16)
    for salt, lora in [("", ""), ("t", ""), ("", "sql"), ("t", "sql"), ("", "poet")]:
        assert RequestKeys(ids, salt, lora).for_page_size(16) == cache.keys(ids, salt, lora)
    roots = {chain_root(s, a) for s, a in [("", ""), ("sql", ""), ("", "sql"), ("x", "sql"), ("", "poet")]}
    assert len(roots) == 5
    # the adapter's name leads its root: no salt turns one adapter's root into another's
    assert chain_root("b", "a") != chain_root("", "ab")
    assert RequestKeys(ids, "", "sql").extended(ids + [1] * 16).for_page_size(16) == cache.keys(
        ids + [1] * 16, "", "sql")


def test_start_refusals():
    assert lora_adapters(True, ["sql=/a", "poet=/b"], {"base"}) == {"sql": "/a", "poet": "/b"}
    assert lora_adapters(False, [], {"base"}) == {}
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_adapters(False, ["sql=/a"], {"base"})
    with pytest.raises(ValueError, match="base model"):
        lora_adapters(True, ["base=/a"], {"base"})
