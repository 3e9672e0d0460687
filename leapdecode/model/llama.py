"""The Llama family in one file: Llama 2/3.x, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm), set by ModelConfig.

Weights live in their final layout: q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj``; the loader
copies each checkpoint tensor straight into its slice (see ``stacked_params``).
"""
from __future__ import annotations

import torch
from torch import nn

from leapdecode.attention.backend import AttentionBackend, AttentionMetadata
from leapdecode.model.config import ModelConfig
from leapdecode.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope, self.backend = rope, backend
        self.scale = self.head_dim ** -0.5
        # [2, blocks, block_size, Hkv, D] (or a quantized cache's layer view, see kv_cache.py), bound by the runner
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(meta.positions, q, k)
        self.backend.write_kv(k, v, self.kv_cache, meta)
        o = self.backend.attend(q, self.kv_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rope = rope
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, *, start_layer: int = 0,
                end_layer: int | None = None, hidden: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                captured: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run layers [start_layer, end_layer) over a flat batch, from the token embeddings or from ``hidden`` (the
        residual stream entering ``start_layer``). Returns the final normed hidden states when the range reaches
        the last layer, else the residual stream. ``capture`` lists hidden states to store in ``captured``, in
        Hugging Face's numbering: i = the stream after i layers (0: embeddings), num_layers = after the final norm."""
        end = len(self.layers) if end_layer is None else end_layer
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        for i in range(start_layer, end):
            if i in capture:
                captured[i] = x
            x = self.layers[i](x, meta)
        if end < len(self.layers):
            if end in capture:
                captured[end] = x
            return x
        x = self.norm(x)
        if end in capture:
            captured[end] = x
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]
