"""Building blocks of the Llama family: RMSNorm, rotary embedding (default / linear / llama3), gated MLP.

On CUDA each block runs as one fused Triton kernel (model/triton_ops.py) computing what its PyTorch form below
computes; on the CPU, in float32, RMSNorm and the rotary embedding run as C++ ops (model/cpu_ops.py); the PyTorch
forms are the reference and the path everywhere else. ``FUSED_OPS = False`` (or the environment variable
LEAPDECODE_FUSED_OPS=0) keeps both devices on the PyTorch forms, for measuring what the fusion buys.
"""
from __future__ import annotations

import math
import os

import torch
from torch import nn
import torch.nn.functional as F

from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.model.parallel_layers import ColumnParallelLinear, Piece, RowParallelLinear


FUSED_OPS = os.environ.get("LEAPDECODE_FUSED_OPS", "1") != "0"


def _fused(x: torch.Tensor, *params: torch.Tensor):
    """The fused kernels module for ``x`` when fusion is on: Triton on a GPU; C++ on the CPU for float32, where it
    compiled (model/cpu_ops.py); else None (the PyTorch forms below). None too where autograd must see the op
    (``x`` or a weight in ``params`` requires a gradient): the fused kernels have no backward, and through them a
    trained draft head (spec/eagle.py, spec/kangaroo.py, spec/online.py) got no gradient past its norms."""
    if not FUSED_OPS:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    if x.is_cuda:
        from leapdecode.model import triton_ops
        return triton_ops
    if x.dtype == torch.float32 and x.device.type == "cpu":
        from leapdecode.model import cpu_ops
        return cpu_ops if cpu_ops.available() else None
    return None


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as Hugging Face does (so logits match)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = _fused(x, self.weight)
        if ops is not None and x.stride(-1) == 1:
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, computed once (rotate-half layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.build(torch.empty(0).device)

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables in float32 on ``device``; the loader calls it after materialising the model."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k; on CUDA rotated in place (they are views of the fused qkv output, used once)."""
        ops = _fused(q, k)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            return ops.rope_(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)   # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul; under tensor parallelism gate/up are split by
    intermediate features and down by its inputs (one all-reduce, see parallel_layers.py)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: ParallelState = SINGLE) -> None:
        super().__init__()
        start, rows = tp.span(intermediate)
        piece = Piece(intermediate, start, rows)
        self.gate_up_proj = ColumnParallelLinear(hidden, [piece, piece], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = _fused(gate_up)
        if ops is not None and gate_up.dim() == 2:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
