"""The Llama family in one file: Llama 2/3.x, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm), set by ModelConfig.

Weights live in their final layout: q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj``; the loader
copies each checkpoint tensor straight into its slice (see ``stacked_params``). Under tensor parallelism (``tp``)
each rank builds the same model over its shard: its heads, its slice of the MLP and of the vocabulary
(model/parallel_layers.py); the residual stream and the final hidden states are whole on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

from leapdecode.attention.backend import AttentionBackend, AttentionMetadata
from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.model import cpu_layer
from leapdecode.model.config import ModelConfig
from leapdecode.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from leapdecode.model.parallel_layers import (ColumnParallelLinear, ParallelLMHead, Piece, RowParallelLinear,
                                              VocabParallelEmbedding, head_shard)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer_idx: int,
                 tp: ParallelState = SINGLE) -> None:
        super().__init__()
        self.layer_idx = layer_idx      # passed to the backend, for sparse attention's selection layers
        heads, d = head_shard(cfg, tp), cfg.head_dim        # this rank's heads (all of them at TP=1)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv = Piece(cfg.num_kv_heads * d, heads.kv_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [Piece(cfg.num_heads * d, heads.q_start * d,
                                                                     self.q_size), kv, kv], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp)
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
        self.backend.write_kv(k, v, self.kv_cache, meta, layer=self.layer_idx)
        o = self.backend.attend(q, self.kv_cache, meta, self.scale, layer=self.layer_idx)
        return self.o_proj(o.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer_idx: int,
                 tp: ParallelState = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, backend, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.cpu_step is not None:           # the CPU's small steps: the whole layer in one C++ call
            out = cpu_layer.run(self, x, meta)
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our fused parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 tp: ParallelState = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rope = rope
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, backend, i, tp) for i in range(cfg.num_layers))
        # the same layers as a plain list, called through ``forward``: ModuleList indexing and Module.__call__ cost
        # ~8 us a layer (0.24 ms of a batch-1 CPU step of 8 ms); no hooks are registered on them
        self._layer_list: list[DecoderLayer] = list(self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, *, start_layer: int = 0,
                end_layer: int | None = None, hidden: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                captured: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run layers [start_layer, end_layer) over a flat batch, from the token embeddings or from ``hidden`` (the
        residual stream entering ``start_layer``). Returns the final normed hidden states when the range reaches
        the last layer, else the residual stream. ``capture`` lists hidden states to store in ``captured``, in
        Hugging Face's numbering: i = the stream after i layers (0: embeddings), num_layers = after the final norm."""
        layers = self._layer_list
        end = len(layers) if end_layer is None else end_layer
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if meta.cpu_step is not None and start_layer < end and not any(start_layer <= i < end for i in capture):
            # the CPU's small steps: every layer of the range in one C++ call where each qualifies (cpu_layer.py)
            stack = cpu_layer.stack_of(self, layers)
            out = stack(x, meta, range(start_layer, end)) if stack is not None else None
            if out is not None:
                x, start_layer = out, end
        for i in range(start_layer, end):
            if i in capture:
                captured[i] = x
            x = layers[i].forward(x, meta)
        if end < len(layers):
            if end in capture:
                captured[end] = x
            return x
        x = self.norm(x)
        if end in capture:
            captured[end] = x
        return x

    @property
    def output_head(self) -> nn.Module:
        """The module that turns hidden states into logits: the LM head, or the embedding when they are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the whole vocabulary; under tensor parallelism on rank 0 only (None elsewhere)."""
        logits = self.output_head.logits(hidden)
        return None if logits is None else logits.float()
