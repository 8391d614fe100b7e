"""Tiny random Llama / Qwen2 checkpoints built offline with transformers (a test-only dependency)."""

from __future__ import annotations

import pathlib

import torch

# Larger than transformers' default 0.02 so logits are well separated and greedy choices are
# not near-ties that float rounding could flip.
INIT_RANGE = 0.15


def save_tiny_llama(folder: pathlib.Path, *, llama3_rope: bool = True, seed: int = 0) -> pathlib.Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_qwen2(folder: pathlib.Path, *, seed: int = 1, max_shard_size: str | None = None) -> pathlib.Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # q/k/v biases start at zero; make them non-zero so the test can see a missing bias.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    return folder
