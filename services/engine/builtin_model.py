"""`--model builtin-random`: a tiny Llama created deterministically from a seed, no files needed.

Not the default: `builtin` is the trained folder models/pdmesh-tiny (scripts/train_builtin.py),
loaded like any checkpoint. This one stays for tests and benchmarks that want byte-level tokens
(services/common/builtin_tokenizer.py: every id below 256 is one byte) and no files at all.

Weights are drawn with fan-in scaling (not the usual 0.02) so that logits are well separated:
greedy decoding then does not sit on near-ties that float rounding could flip between a batched
and an unbatched run.

Random weights produce random bytes, most of them not printable (and invalid UTF-8). So that a
reply shows characters rather than U+FFFD, one hidden channel is made a
constant: every embedding carries PRINTABLE_BIAS_INPUT in channel 0 and no layer writes to it,
so after the final RMSNorm that channel is always positive, and the LM head's weights on it add
a logit bonus to printable ASCII and a malus to every other token. It is still an ordinary
Llama (the transformers comparison in bench/engine.py runs these exact weights).
"""

from __future__ import annotations

import math

import torch

from services.common.builtin_tokenizer import BUILTIN_BOS_ID, BUILTIN_EOS_IDS, BUILTIN_VOCAB_SIZE
from services.engine.model import CausalLM
from services.engine.model_config import ModelConfig

BUILTIN_NAME = "pdmesh-tiny"  # served under the built-in model's name (tests address it so)
BUILTIN_SEED = 20261129
PRINTABLE_BIAS_INPUT = 8.0  # value of hidden channel 0 in every embedding
PRINTABLE_BIAS_WEIGHT = 0.6  # LM-head weight on channel 0: + for printable ASCII, - otherwise
PRINTABLE_IDS = (10, *range(32, 127))  # newline and ' '..'~' (byte tokens are their own ids)


def builtin_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=BUILTIN_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,  # grouped-query attention, like the real models
        head_dim=32,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BUILTIN_BOS_ID,
        eos_token_ids=BUILTIN_EOS_IDS,  # <|eos|> and the chat template's <|end|>
        name=BUILTIN_NAME,
    )


def builtin_model() -> CausalLM:
    """Always the same weights (on CPU, float32); move with .to(device, dtype)."""
    config = builtin_config()
    model = CausalLM(config)
    gen = torch.Generator().manual_seed(BUILTIN_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
        model.model.embed_tokens.weight[:, 0] = PRINTABLE_BIAS_INPUT
        for layer in model.model.layers:  # nothing writes into channel 0 of the residual stream
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = -PRINTABLE_BIAS_WEIGHT
        model.lm_head.weight[list(PRINTABLE_IDS), 0] = PRINTABLE_BIAS_WEIGHT
    return model.eval()
