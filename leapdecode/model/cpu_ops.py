"""Fused elementwise ops for the model on the CPU: RMSNorm and rotary embedding, one call each instead of the 6
and ~16 PyTorch ops their forms in ``layers.py`` cost (the CPU's counterpart of model/triton_ops.py, same
signatures).

Why: at batch 1 a CPU decode step of SmolLM2-135M is ~20% small ops around its matrix products, and a draft that
reads int8 weights (spec/layer_skip.py) more than half: each op is a few microseconds of dispatch for a few
kilobytes of arithmetic. Dropping the norms and the rotary embedding altogether took 2 ms off a 16 ms step.

Exactness: the rotary embedding computes exactly what ``_rotate`` does (the same products and sums in float32,
each rounded, no fused multiply-add: ``-ffp-contract=off``), so it is bit-identical to the PyTorch form. RMSNorm
sums the squares in double in index order (PyTorch's float32 mean sums in vector lanes), so its result can differ
from the PyTorch form's in the last bit; each row is computed alone in one fixed order, so a row's result does not
depend on the rows beside it (batch invariance, as the engine needs for lossless speculation). Float32 only; other
dtypes keep the PyTorch forms. ``layers.FUSED_OPS = False`` turns them off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from leapdecode import native

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

// y[t] = w * (x[t] * r), r = 1 / sqrt(sum(x[t]^2) / n + eps), the sum in double in index order: one row alone.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "rms_norm: float32 only");
  const int64_t n = x.size(-1);
  auto x2 = x.reshape({-1, n});
  TORCH_CHECK(n == 0 || x2.stride(1) == 1, "rms_norm: the last dimension must be contiguous");
  const int64_t rows = x2.size(0), sx = x2.stride(0);
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * sx;
      float* yr = op + t * n;
      double ss = 0.0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
      for (int64_t i = 0; i < n; ++i) yr[i] = wp[i] * (xr[i] * r);
    }
  });
  return out.view(x.sizes());
}

template <typename P>
void rotate(const P* pos, float* base, int64_t T, int64_t H, int64_t st, int64_t sh, int64_t half,
            const float* cos, const float* sin, int64_t sc) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + static_cast<int64_t>(pos[t]) * sc;
      const float* s = sin + static_cast<int64_t>(pos[t]) * sc;
      for (int64_t h = 0; h < H; ++h) {
        float* x = base + t * st + h * sh;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
          x[i] = a - b;
          x[i + half] = e + f;
        }
      }
    }
  });
}

// q [T, H, D] and k [T, Hkv, D] rotated in place (rotate-half layout); cos/sin [max_positions, D/2] float32.
void rope_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32, "rope_: float32 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rope_: contiguous heads and tables");
  const int64_t T = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(k.size(0) == T && positions.numel() >= T && cos.size(1) == half, "rope_: shape mismatch");
  auto pos = positions.contiguous();
  for (int which = 0; which < 2; ++which) {
    torch::Tensor x = which == 0 ? q : k;
    if (pos.scalar_type() == torch::kLong)
      rotate(pos.data_ptr<int64_t>(), x.data_ptr<float>(), T, x.size(1), x.stride(0), x.stride(1), half,
             cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
    else
      rotate(pos.data_ptr<int32_t>(), x.data_ptr<float>(), T, x.size(1), x.stride(0), x.stride(1), half,
             cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  }
}
"""


def _module():
    return native.kernels()


def available() -> bool:
    """Whether the ops compiled on this machine (see leapdecode/native.py)."""
    return _module() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of float32 ``x`` (a weight in another dtype is promoted, as PyTorch would)."""
    return _module().rms_norm(x, weight if weight.dtype == torch.float32 else weight.float(), float(eps))


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, H, D] and k [T, Hkv, D] in place (float32, contiguous heads)."""
    _module().rope_(positions, q, k, cos, sin)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] (gate, up) -> silu(gate) * up: PyTorch's own two ops (a fused C++ one would need PyTorch's
    exp to match it; it saves little)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


__all__ = ["available", "rms_norm", "rope_", "silu_and_mul"]
