"""Llama-family decoder (Llama 2/3, Qwen2) in plain torch, reading and writing a paged KV cache.

Parameter names follow Hugging Face's LlamaForCausalLM so checkpoints load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention_metadata import AttentionMetadata
from services.engine.kv_pool import KVPool
from services.engine.model_config import ModelConfig
from services.engine.rope import RotaryEmbedding, apply_rope


class Linear(nn.Linear):
    """nn.Linear, left uninitialized when built on the meta device: a checkpoint's weights replace
    them, and initializing meta tensors runs through torch._refs, whose first call imports
    torch._dynamo (about a second of every worker's start). A layer LoRA adapters target adds
    their updates for the rows of the requests that named them (services/engine/lora.py)."""

    lora = None  # a LoraLayer once an adapter targets this layer

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        lora = self.lora
        if lora is None or not lora.selection.groups:
            return y
        return lora.add(x, y)


class Embedding(nn.Embedding):
    """nn.Embedding, left uninitialized on the meta device (as Linear)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        pool.write(self.layer_idx, meta.write_page, meta.write_off, k, v)
        if meta.is_decode:
            out = self._decode_attention(q, meta, pool)
        else:
            out = self._prefill_attention_all(q, k, v, meta, pool)
        return self.o_proj(out)

    def _prefill_attention_all(self, q, k, v, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        """Fresh prompts of similar length attend in stacked calls (meta.fresh_batches); the
        others, and chunks that continue a cached sequence, attend one by one."""
        outs: dict[int, torch.Tensor] = {}
        for fb in meta.fresh_batches or ():
            stacked = self._fresh_attention(q, k, v, fb)  # [B, L, h*d]
            for i, s in enumerate(fb.spans):
                outs[id(s)] = stacked[i, : s.num_tokens]
        return torch.cat(
            [outs[id(s)] if id(s) in outs else self._prefill_attention(q, k, v, s, pool) for s in meta.spans]
        )

    def _fresh_attention(self, q, k, v, fb) -> torch.Tensor:
        """Causal attention of fresh prompts stacked and padded to the longest: [B, L, h*d]."""
        qs = q[fb.rows].transpose(1, 2)  # [B, h, L, d]
        ks = k[fb.rows].transpose(1, 2)
        vs = v[fb.rows].transpose(1, 2)
        if fb.mask is None:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=fb.mask, enable_gqa=True)
        b, length = fb.rows.shape
        return out.transpose(1, 2).reshape(b, length, self.num_heads * self.head_dim)

    def _prefill_attention(self, q, k, v, span, pool: KVPool) -> torch.Tensor:
        rows = slice(span.start, span.start + span.num_tokens)
        qs = q[rows].transpose(0, 1)  # [h, n, d]
        if span.start_pos == 0:
            # a fresh prompt: its whole context is this chunk, already at hand (no gather)
            keys, values, mask, causal = k[rows], v[rows], None, True
        else:
            keys, values = pool.gather(self.layer_idx, span.gather_page, span.gather_off)  # [ctx, kvh, d]
            mask, causal = span.mask, False
        out = F.scaled_dot_product_attention(
            qs,
            keys.to(q.dtype).transpose(0, 1),
            values.to(q.dtype).transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        return out.transpose(0, 1).reshape(span.num_tokens, self.num_heads * self.head_dim)

    def _decode_attention(self, q, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        keys, values = pool.gather(self.layer_idx, meta.decode_page, meta.decode_off)  # [b, s, kvh, d]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [b, h, 1, d]
            keys.to(q.dtype).transpose(1, 2),
            values.to(q.dtype).transpose(1, 2),
            attn_mask=meta.decode_mask[:, None, None, :],
            enable_gqa=True,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, meta, pool):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] packed; returns float32 logits for `logits_rows` (default: all rows)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(meta.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta, pool)
        if logits_rows is not None:
            x = x[logits_rows]  # the LM head only for tokens we sample from
        return self.lm_head(self.model.norm(x)).float()
