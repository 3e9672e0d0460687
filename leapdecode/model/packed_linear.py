"""Float32 linears on the CPU with each weight packed once: our own kernel for rows streamed past the weights
(AVX-512), else oneDNN.

Why: on a CPU a decode step reads every weight for a handful of rows, and ``F.linear`` (MKL's sgemm in PyTorch's
CPU builds) handles few rows badly on some machines. Measured on the 2-core AMD EPYC VM this project tests on
(AVX2, torch 2.13.0+cpu, 2 threads), all linears of SmolLM2-135M (30 layers and the LM head, 540 MB float32)
with weights streamed from memory as in a real step (benchmarks/cpu_linears.py): MKL 44 ms for 1 row, 80 ms for 2,
87 ms for 5, 118 ms for 17; oneDNN with prepacked weights 31, 28, 40 and 66 ms. End to end that is 1.33x plain
decoding at batch 1 and 1.38x at batch 16, and verifying 4 draft tokens costs 1.3x a plain step's matmuls instead
of 2.0x: it decides whether speculation can pay on a CPU at all. (On tiny matrices, e.g. the embedded test models,
one row is slower packed: the packing is on wherever available, not decided by timing, see :func:`pack_model`.)

**The row kernel** (``_SOURCE``, compiled at first use by leapdecode/native.py) goes further where it builds. The
weight is packed as blocks of 16 output features, each block's [K, 16] slab contiguous, so a tile of up to 6 rows
x 4 blocks streams four slabs once (prefetched ahead) while every row in the tile multiplies them: a step reads
the weights once at the memory's speed for 1 row as for 17. Each output is one FMA chain over the inputs in
order, the same instructions whichever tile computes it, so a row's result does not depend on how many rows share
the call (:func:`row_independent` checks it at start-up; a machine where it fails keeps oneDNN). On the 2-core
Intel Xeon VM of 2026-11-29 (AVX-512; all linears of the default model, benchmarks/cpu_linears.py, two runs):
oneDNN 22-24 ms for 1 row, 26-31 for 5, 30-35 for 9, 37-42 for 17, 452-560 for 512; the row kernel 19-22, 20-25,
25-29, 29-34 and the same as oneDNN for 512. Decoding 1.17x oneDNN's speed at batch 1, 1.30x at batch 16. The
same tiles read int8 slabs for drafters (model/int8_linear.py: widened in registers, a scale per output at the
end), and model/cpu_layer.py runs them inside its one-call decoder layer.

Either way the results differ from MKL's in the last bits (different summation order; about 6e-5 on outputs of
size ~10) and a row's result does not depend on how many rows share the call.

The oneDNN kernel is ``torch.ops.mkldnn._linear_pointwise`` with a weight from
``torch.ops.mkldnn._reorder_linear_weight``, the pair PyTorch's own CPU compiler (inductor) emits for frozen
linears. Both are internal ops: :func:`available` tries them once and callers keep ``F.linear`` where they are
missing or disagree with it. Only float32 on the CPU, and only without tensor parallelism (a row-parallel layer's
all-reduce stays with ``F.linear``).

Memory: a packed layer keeps only the packed weight; ``weight`` returns a dense copy for code that reads weights
at set-up (int8 drafts, EAGLE binding). The LM head is packed as an extra copy (the embedding table stays dense
for lookups): about a fifth of SmolLM2-135M's weight bytes more.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
import torch.nn.functional as F


_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// One vector holds 16 floats (an AVX-512 register); RMAX x VMAX is the largest tile, sized to the 32 registers.
// Only AVX-512: an AVX2 form (two 8-lane halves, tiles of 3 x 2) ran 1.3x slower than oneDNN at 64 rows on the
// Intel VM (8 fewer registers, half the width), which would cost batched decoding and prefill on AVX2 machines.
#if defined(__AVX512F__)
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(float a, vec b, vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static constexpr int RMAX = 6, VMAX = 4;
#define ROWS_SUPPORTED 1
#endif

bool rows_supported() {
#ifdef ROWS_SUPPORTED
  return true;
#else
  return false;
#endif
}

#ifdef ROWS_SUPPORTED
static constexpr int L = 16;         // outputs per block
static constexpr int64_t AHEAD_BYTES = 4096;  // how far ahead in its slab each tile prefetches

// The weight as floats, 16 at a time: a float32 slab as it is, an int8 one widened (its scale comes at the end).
static inline vec wload(const float* p) { return vload(p); }
static inline vec wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// y[r][n0 + v*16 + j] = (((0 + x[r][0] w[0]) + x[r][1] w[1]) + ...) * scale + bias: one FMA chain per output, in
// order (float32 weights have no scale).
template <int R, int V, typename W>
static inline void tile(const float* __restrict x, int64_t K, const W* __restrict w, float* __restrict y,
                        int64_t N, int64_t n0, const float* scale, const float* bias) {
  constexpr int64_t AHEAD = AHEAD_BYTES / (L * sizeof(W));   // in inputs: 64 for float32, 256 for int8
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  const int64_t slab = K * L;
  for (int64_t k = 0; k < K; ++k) {
    vec wk[V];
    for (int v = 0; v < V; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(w + v * slab + (k + AHEAD) * L), _MM_HINT_T0);
      wk[v] = wload(w + v * slab + k * L);
    }
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xr, wk[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      vec out = scale ? _mm512_mul_ps(acc[r][v], vload(scale + n0 + v * L)) : acc[r][v];
      vstore(y + r * N + n0 + v * L, bias ? vadd(out, vload(bias + n0 + v * L)) : out);
    }
}

template <int V, typename W>
static void blocks(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t n0,
                   const float* scale, const float* bias) {
  int64_t m = 0;
  for (; m + RMAX <= M; m += RMAX) tile<RMAX, V>(x + m * K, K, w, y + m * N, N, n0, scale, bias);
  const float* xm = x + m * K;          // the rest in one tile (each pass re-reads the slabs from the cache)
  float* ym = y + m * N;
  switch (M - m) {
    case 5: tile<5, V>(xm, K, w, ym, N, n0, scale, bias); break;
    case 4: tile<4, V>(xm, K, w, ym, N, n0, scale, bias); break;
    case 3: tile<3, V>(xm, K, w, ym, N, n0, scale, bias); break;
    case 2: tile<2, V>(xm, K, w, ym, N, n0, scale, bias); break;
    case 1: tile<1, V>(xm, K, w, ym, N, n0, scale, bias); break;
    default: break;
  }
}

// x [M, K] float32 contiguous; w packed [N/16, K, 16] of W; scale [N] or null; bias [N] or null. Returns y [M, N].
template <typename W>
static torch::Tensor run_rows(const torch::Tensor& x, const torch::Tensor& w, const float* scale,
                              const float* bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "rows_linear: x");
  const int64_t M = x.size(0), K = x.size(1), nb = w.size(0), N = nb * L;
  TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == L && w.is_contiguous(), "rows_linear: w");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  pybind11::gil_scoped_release free_python;   // the grammar's mask fill runs in another thread meanwhile
  const int64_t groups = (nb + VMAX - 1) / VMAX;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * VMAX, v = std::min<int64_t>(VMAX, nb - b);
      const W* wb = wp + b * K * L;
      if (v == VMAX) blocks<VMAX>(xp, M, K, wb, yp, N, b * L, scale, bias);
      else if (v == 3) blocks<3>(xp, M, K, wb, yp, N, b * L, scale, bias);
      else if (v == 2) blocks<2>(xp, M, K, wb, yp, N, b * L, scale, bias);
      else blocks<1>(xp, M, K, wb, yp, N, b * L, scale, bias);
    }
  });
  return y;
}

static const float* optional(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.numel() == 0 || (t.numel() == n && t.is_contiguous() && t.scalar_type() == torch::kFloat32), what);
  return t.numel() ? t.data_ptr<float>() : nullptr;
}
#endif

// x [M, K] float32 contiguous; w float32 packed [N/16, K, 16]; bias [N] or empty. Returns y [M, N].
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
#ifdef ROWS_SUPPORTED
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "rows_linear: w must be float32");
  return run_rows<float>(x, w, nullptr, optional(bias, w.size(0) * L, "rows_linear: bias"));
#else
  TORCH_CHECK(false, "rows_linear: this CPU has no AVX-512");
  return x;
#endif
}

// The same with w int8 packed [N/16, K, 16] and a float32 scale per output feature (y = (x q^T) * scale + bias).
torch::Tensor rows_linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
#ifdef ROWS_SUPPORTED
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && scale.numel() == w.size(0) * L, "rows_linear_int8: w, scale");
  return run_rows<int8_t>(x, w, optional(scale, w.size(0) * L, "rows_linear_int8: scale"),
                          optional(bias, w.size(0) * L, "rows_linear_int8: bias"));
#else
  TORCH_CHECK(false, "rows_linear_int8: this CPU has no AVX-512");
  return x;
#endif
}
"""

BLOCK = 16    # output features per packed block of the row kernel
ABSENT = torch.empty(0)   # the row kernel's absent bias or scale (read only)


@functools.lru_cache(maxsize=1)
def _build_rows():
    """The compiled row kernel, or None where it does not build or this CPU has no AVX-512."""
    from leapdecode import native
    mod = native.kernels()
    return mod if mod is not None and mod.rows_supported() else None


@functools.lru_cache(maxsize=1)
def rows_kernel():
    """The row kernel where it builds and runs exactly here: agrees with F.linear, rows independent (else None:
    oneDNN serves)."""
    from leapdecode.model.int4_linear import row_independent
    mod = _build_rows()
    if mod is None:
        return None
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(80, 72, generator=g), torch.randn(80, generator=g)
    packed, bias = pack_rows(w), b.contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        return mod.rows_linear(x.contiguous(), packed, bias)

    x = torch.randn(9, 72, generator=g)
    exact = F.linear(x.double(), w.double(), b.double()).float()
    if not torch.allclose(run(x), exact, rtol=1e-5, atol=1e-4) or not row_independent(run, 72, max_rows=40):
        return None
    return mod


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]: each block of 16 output features as one contiguous [K, 16] slab (dtype kept)."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight of :func:`pack_rows`' blocks (a copy)."""
    nb, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(nb * BLOCK, k).clone()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once: the row kernel's blocks where it runs here (and N is a multiple of 16),
    else oneDNN's layout (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = "rows" if self.out_features % BLOCK == 0 and rows_kernel() is not None else "oneDNN"
        self.packed = pack_rows(weight.float()) if self.kernel == "rows" else _pack(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight (exact: packing only reorders), for set-up code; not used by ``forward``."""
        return unpack_rows(self.packed) if self.kernel == "rows" else self.packed.to_dense()

    def row_parts(self) -> list[torch.Tensor] | None:
        """(weight, scale, bias) as the row kernel takes them (scale absent: float32), or None under oneDNN."""
        if self.kernel != "rows":
            return None
        return [self.packed, ABSENT, ABSENT if self.bias is None else self.bias.data]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "rows":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        y = rows_kernel().rows_linear(rows if rows.is_contiguous() else rows.contiguous(), self.packed,
                                   ABSENT if self.bias is None else self.bias.data)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"kernel={self.kernel}"


@functools.lru_cache(maxsize=None)
def _works() -> bool:
    """Whether this build packs and runs a linear through oneDNN, agreeing with F.linear to float32 rounding."""
    try:
        g = torch.Generator().manual_seed(0)
        w, b, x = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(3, 40, generator=g)
        y = PackedLinear(w, b)(x)
        return bool(y.shape == (3, 24) and torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model in ``dtype`` on ``device`` can run its linears packed (float32 on a CPU with oneDNN)."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and _works()


def pack_model(model: nn.Module, enable: bool | None = None) -> int:
    """Pack, in place, the linears of a leapdecode Llama model's layers and its LM head (see the module
    docstring). ``enable``: None = wherever available (not decided by a timing at start-up: the choice changes the
    last bits of results, so it must not depend on a noisy measurement), True = the same, with a ValueError off a
    float32 CPU, False = nothing. Returns how many weights were packed."""
    from leapdecode.model.int8_linear import linear_names, replace_linears
    head = model.output_head
    param = next(model.parameters())
    if enable is False or getattr(head, "tp", None) is not None and head.tp.size > 1:
        return 0
    if not available(param.dtype, param.device):
        if enable:
            raise ValueError("cpu_packed_linears=True needs a float32 model on a CPU with PyTorch's oneDNN "
                             f"(got {param.dtype} on {param.device.type})")
        return 0
    names = linear_names(model.layers)
    if not names:
        return 0
    replace_linears(model.layers, names, lambda m: PackedLinear(m.weight, getattr(m, "bias", None)))
    if head.packed_logits is not None:          # already given its own form (model/int4_linear.py: bfloat16)
        return len(names)
    head.packed_logits = PackedLinear(head.weight)
    return len(names) + 1


__all__ = ["ABSENT", "BLOCK", "PackedLinear", "available", "pack_model", "pack_rows", "rows_kernel", "unpack_rows"]
