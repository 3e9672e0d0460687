"""Owns the model, the KV cache and the input buffers; turns a step plan into one forward pass and logits rows.

This is the executor the engine talks to (see ``engine/executor.py``): it sees only the plan's plain data, never a
live ``Sequence``. Logits are computed only where a next token is needed: the rows a sequence samples (the last
token of its chunk and each draft node) and, when asked, every prompt position for prompt logprobs.

Under tensor parallelism every rank has a runner over its shard (engine/tp_executor.py): the same plan, the same
forward, its own KV heads in its own pool; rank 0 gets the logits (the others get ``logits=None``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from leapdecode.attention.backend import get_backend
from leapdecode.attention.kv_cache import KVCache
from leapdecode.config import EngineConfig
from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.engine.input_batch import ForwardBatch, InputBuffers
from leapdecode.engine.step import StepPlan
from leapdecode.model.config import ModelConfig
from leapdecode.model.loader import load_model
from leapdecode.model.parallel_layers import head_shard

if TYPE_CHECKING:
    from leapdecode.attention.sparse import SparseAttention

CPU_KV_CAP = 2 << 30    # CPU default: at most 2 GiB of KV (pages are only touched when used)


@dataclass
class ForwardOutput:
    logits: torch.Tensor                                    # [R, vocab] float32 (None on ranks > 0 of a TP group)
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)   # HF numbering, rows as ``logits``


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, max_model_len: int,
                 tp: ParallelState = SINGLE, agree_blocks: Callable[[int], int] | None = None) -> None:
        """``tp``: this runner's rank in a tensor-parallel group (it loads its shard, its KV pool holds its KV
        heads); ``agree_blocks``: turns this rank's KV block count into the group's (every rank the same pool)."""
        self.cfg, self.model_cfg, self.dtype, self.tp = cfg, model_cfg, dtype, tp
        self.device = cfg.torch_device
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        self.backend = get_backend(cfg.attention_backend, self.device, _sparse_attention(cfg, model_cfg))
        self.model = load_model(cfg.model, model_cfg, self.backend, dtype, self.device, max_model_len, tp)
        c = self._kv_view = replace(model_cfg, num_kv_heads=head_shard(model_cfg, tp).num_kv_heads)
        self.num_blocks = self._num_blocks(max_model_len)
        if agree_blocks is not None:
            self.num_blocks = agree_blocks(self.num_blocks)
        # blocks past the block manager's pool, written only by a drafter that runs the target itself
        # (spec/layer_skip.py), so draft KV never lands in a slot the target owns
        self.num_scratch_blocks = _scratch_blocks(cfg)
        self.kv_cache = KVCache(c.num_layers, self.num_blocks + self.num_scratch_blocks, self.block_size,
                                c.num_kv_heads, c.head_dim, dtype, self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache.layer(i)
        self.buffers = InputBuffers(self.device)
        self.pad = cfg.pad_to_buckets if cfg.pad_to_buckets is not None else self.device.type == "cuda"

    @property
    def kv_bytes_per_block(self) -> int:
        c = self._kv_view           # this rank's KV heads: under tensor parallelism a block is 1/N as large
        return KVCache.bytes_per_block(c.num_layers, self.block_size, c.num_kv_heads, c.head_dim, self.dtype)

    def _num_blocks(self, max_model_len: int) -> int:
        if self.cfg.num_kv_blocks is not None:
            blocks = self.cfg.num_kv_blocks
        else:
            budget = self.cfg.kv_cache_memory
            if budget is None:
                budget = self._default_kv_budget(max_model_len)
            blocks = budget // self.kv_bytes_per_block
        need = -(-max_model_len // self.block_size)
        if blocks < need:
            raise ValueError(
                f"the KV cache ({blocks} blocks of {self.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens ({need} blocks): raise kv_cache_memory or lower max_model_len")
        return blocks

    def _default_kv_budget(self, max_model_len: int) -> int:
        """CUDA: 90% of what is free after the weights; CPU: room for max_num_seqs full sequences, at most 2 GiB."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        want = self.cfg.max_num_seqs * max_model_len // self.block_size * self.kv_bytes_per_block
        return max(min(want, CPU_KV_CAP), -(-max_model_len // self.block_size) * self.kv_bytes_per_block)

    # -- one step ----------------------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """The plan's inputs in the persistent buffers (one host-to-device copy)."""
        return self.buffers.build(plan, self.model_cfg.sliding_window, self.pad,
                                  -(-self.max_model_len // self.block_size))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, batch: ForwardBatch | None = None, last_sampled: torch.Tensor | None = None,
                capture: tuple[int, ...] = (), all_rows: bool = False) -> ForwardOutput:
        """One forward over the plan -> float32 logits for its logits rows (and the hidden states of the layers
        in ``capture``, HF numbering: 0 = embeddings, i = after layer i, L = after the final norm; for the logits
        rows, or with ``all_rows`` for every token of the plan in order: what an EAGLE head reads).
        ``last_sampled``: the previous step's sampled tokens, for the plan's placeholders."""
        batch = batch if batch is not None else self.prepare(plan)
        if batch.kv_moves is not None:
            self.kv_cache.copy_slots(*batch.kv_moves)
        if batch.placeholders is not None:    # rank 0 holds the sampled tokens; the other ranks receive them
            idx, rows = batch.placeholders
            tokens = last_sampled[rows].to(idx.dtype) if self.tp.is_first else torch.empty_like(idx)
            batch.input_ids[idx] = self.tp.broadcast(tokens)
        self.backend.plan(batch.meta)
        captured: dict[int, torch.Tensor] = {}
        hidden = self.model(batch.input_ids, batch.meta, capture=capture, captured=captured)
        rows = batch.logits_indices
        keep = slice(0, plan.num_tokens) if all_rows else rows
        return ForwardOutput(self.model.compute_logits(hidden[rows]), {i: h[keep] for i, h in captured.items()})

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of given hidden states (DoLa's early exits), through the model's LM head."""
        return self.model.compute_logits(hidden)

    def close(self) -> None:
        """Nothing to release in-process (the executor protocol's shutdown hook)."""


def _sparse_attention(cfg: EngineConfig, model_cfg: ModelConfig) -> SparseAttention | None:
    """The model's lossy sparse decoding settings (attention/sparse.py), or None when off."""
    if cfg.sparse_attention is None:
        return None
    if model_cfg.sliding_window is not None:
        raise ValueError("sparse_attention does not support sliding-window attention models")
    from leapdecode.attention.sparse import SparseAttention
    return SparseAttention(cfg.sparse_attention, model_cfg.num_layers)


def _scratch_blocks(cfg: EngineConfig) -> int:
    spec = cfg.speculative_config
    if spec is None or spec.drafter is not None or spec.method != "layer_skip":
        return 0
    from leapdecode.spec.layer_skip import scratch_blocks_needed
    return scratch_blocks_needed(cfg.block_size, spec.num_speculative_tokens, cfg.max_num_seqs)
