"""Fused elementwise kernels for the model on a GPU: RMSNorm, rotary embedding and SiLU-and-multiply, one launch
each instead of the 8, 20 and 2 small kernels their PyTorch forms cost.

At batch 1 a decode step is a few hundred kernels, most of them elementwise ops on a few kilobytes that still
cost a launch and a couple of microseconds of GPU time each (CUDA graphs remove the launch, not the kernel). On an
H200 the measured static-cache step of Llama-3.2-1B spent about 85 us per layer outside its matrix products.

Each kernel computes what the PyTorch form in ``layers.py`` computes, in the same order and precision: float32
arithmetic, rounded to the model's dtype where PyTorch rounds (so bf16 results match to the ulp apart from
reduction order). ``layers.py`` calls them for CUDA tensors only; the PyTorch forms stay the CPU path and the
reference the tests compare against (tests/test_triton_kernels.py, under the Triton interpreter on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    """One row: y = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the mean in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a [rows, n] tensor whose last dimension is contiguous."""
    n = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps, BLOCK=block,
                                         num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)


@triton.jit
def _rotate_heads(base, t, stride_t, stride_h, heads, cos, sin, d, dmask, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    for h0 in range(0, heads, BLOCK_H):
        hh = h0 + h
        m = (hh < heads)[:, None] & dmask[None, :]
        p = base + t * stride_t + hh[:, None] * stride_h + d[None, :]
        x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(p, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=m)
        tl.store(p + HALF, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_cos, num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """One token: rotate the halves of every q and k head in place (rotate-half layout, float32, rounded once)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0)[None, :]
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, d, dmask, HALF, BLOCK_H)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, d, dmask, HALF, BLOCK_H)


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, D] and k [T, Hkv, D] in place (views with a contiguous last dimension, e.g.
    slices of the fused qkv output); ``cos``/``sin`` are the [max_positions, D/2] float32 tables."""
    T, H, D = q.shape
    if T:
        half = D // 2
        _rope_kernel[(T,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           cos.stride(0), H, k.shape[1], HALF=half, BLOCK_H=min(16, triton.next_power_of_2(H)),
                           BLOCK_D=triton.next_power_of_2(half), num_warps=4)
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    """Program (row, column tile): silu(gate).to(dtype) * up, as F.silu(gate) * up computes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] (gate, up) -> [rows, n] silu(gate) * up."""
    rows, n2 = x.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                            num_warps=4)
    return out
