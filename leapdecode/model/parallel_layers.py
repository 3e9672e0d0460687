"""Megatron-style tensor-parallel layers (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", 2019, arXiv:1909.08053, section 3), for the Llama family.

Each rank of a group of N holds 1/N of every large weight and a transformer block costs two all-reduces:

- the fused q/k/v projection is split by output features, in whole heads (column-parallel), so a rank attends
  over its own heads without talking to the others; its KV cache holds only its KV heads. With fewer KV heads than
  ranks, each rank holds the one KV head its query heads read (replicated across the ranks sharing it);
- the output projection is split by input features (row-parallel): partial products, summed by one all-reduce;
- the MLP follows the same pattern: gate/up column-parallel, down row-parallel, one all-reduce;
- the embedding and the LM head are split by vocabulary: a rank looks up the token ids it owns (zeros for the
  others, then an all-reduce), and computes the logits of its vocabulary slice, gathered on rank 0 (the rank that
  samples).

Each layer also says where its shard lives in the checkpoint (``checkpoint_slices``), so the loader copies every
rank's part straight out of the full tensors (model/loader.py): a process holds its shard plus one tensor at a
time, never the whole model. At TP=1 every layer computes exactly what ``nn.Linear``/``nn.Embedding`` compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import nn
import torch.nn.functional as F

from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.model.config import ModelConfig


@dataclass(frozen=True)
class Slice:
    """One part of a checkpoint tensor this rank keeps: ``count`` indices from ``start`` along ``dim``, copied to
    rows ``[offset, ...)`` of the parameter (a fused parameter stacks the parts of several checkpoint tensors)."""
    dim: int
    start: int
    count: int
    offset: int = 0


class Piece(NamedTuple):
    """One checkpoint tensor fused into a column-parallel layer: its rows, and the rows this rank keeps."""
    full: int
    start: int
    rows: int


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: query heads ``[q_start, +num_heads)``, KV heads
    ``[kv_start, +num_kv_heads)``."""
    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(cfg: ModelConfig, tp: ParallelState) -> HeadShard:
    heads = cfg.num_heads // tp.size
    q_start = tp.rank * heads
    if cfg.num_kv_heads >= tp.size:
        kv = cfg.num_kv_heads // tp.size
        return HeadShard(heads, kv, q_start, tp.rank * kv)
    group = cfg.num_heads // cfg.num_kv_heads          # query heads per KV head
    return HeadShard(heads, 1, q_start, q_start // group)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming ``tensor_parallel_size`` unless the model's heads split evenly over ``size`` ranks (whole
    query heads per rank, and each rank's query heads reading one KV head when KV heads are replicated)."""
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv} KV heads must divide one another "
                         "(KV heads are split over the ranks, or replicated when there are fewer than ranks)")
    if cfg.vocab_size < size:
        raise ValueError(f"tensor_parallel_size={size} exceeds the vocabulary size {cfg.vocab_size}")


class ColumnParallelLinear(nn.Linear):
    """y = x W_r^T + b_r: this rank's output features (rows of W). A fused layer stacks several checkpoint tensors
    (q, k, v or gate, up); ``pieces`` says which rows of each this rank keeps, in order."""

    def __init__(self, in_features: int, pieces: Sequence[Piece], bias: bool) -> None:
        super().__init__(in_features, sum(p.rows for p in pieces), bias=bias)
        self.pieces = tuple(pieces)

    def checkpoint_slices(self, leaf: str, shard: int | None) -> tuple[tuple[int, ...], list[Slice]]:
        """(shape of the checkpoint tensor, this rank's slices): of piece ``shard``, or with ``shard=None`` of a
        tensor already fused in our layout (all pieces stacked)."""
        idx = range(len(self.pieces)) if shard is None else [shard]
        offsets = [sum(p.rows for p in self.pieces[:i]) for i in range(len(self.pieces))]
        starts = [sum(p.full for p in self.pieces[:i]) for i in range(len(self.pieces))] if shard is None \
            else [0] * len(self.pieces)
        rows = sum(self.pieces[i].full for i in idx)
        shape = (rows, self.in_features) if leaf == "weight" else (rows,)
        return shape, [Slice(0, starts[i] + self.pieces[i].start, self.pieces[i].rows, offsets[i]) for i in idx]


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r W_r^T, + b: this rank's input features (columns of W), whose partial products one
    all-reduce sums; the bias (replicated) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelState = SINGLE) -> None:
        self.in_start, local = tp.span(in_features)
        super().__init__(local, out_features, bias=bias)
        self.full_in_features, self.tp = in_features, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def checkpoint_slices(self, leaf: str, shard: int | None) -> tuple[tuple[int, ...], list[Slice]]:
        if leaf == "bias":
            return (self.out_features,), [Slice(0, 0, self.out_features)]
        return (self.out_features, self.full_in_features), [Slice(1, self.in_start, self.in_features)]


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary ``[vocab_start, +num_embeddings)``: a lookup returns the rows it owns and
    zeros for the others, summed over ranks by one all-reduce (exact: every row has one non-zero term). The same
    split serves the LM head (``logits``), tied to this weight or not."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelState = SINGLE) -> None:
        self.vocab_start, local = tp.span(vocab_size)
        super().__init__(local, hidden_size)
        self.vocab_size, self.tp = vocab_size, tp
        self.packed_logits: nn.Module | None = None     # set by model/packed_linear.pack_model (TP=1 only)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden @ W^T over the whole vocabulary on rank 0 (each rank computes its slice); None on other ranks."""
        if self.packed_logits is not None:          # float32 on a CPU: oneDNN, weight packed (model/packed_linear.py)
            return self.packed_logits(hidden)
        return self.tp.gather_last_dim(F.linear(hidden, self.weight), self.vocab_size)

    def checkpoint_slices(self, leaf: str, shard: int | None) -> tuple[tuple[int, ...], list[Slice]]:
        return (self.vocab_size, self.embedding_dim), [Slice(0, self.vocab_start, self.num_embeddings)]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the embedding's vocabulary split (weight ``[vocab, hidden]``), used only for logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.logits(hidden)
