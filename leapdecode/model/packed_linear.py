"""Float32 linears on the CPU with each weight packed once: our own kernel for rows streamed past the weights
(AVX-512; on AVX2 for a GGUF's grid weights only), else oneDNN.

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

**Weights on GGUF grids** (:func:`grid_form`): a quantized GGUF file (the default model is Q4_1, its embedding and
LM head Q8_0) is dequantized to float32 at load, so every group of 32 weights of an output sits on the file's
grid. Where every group of a layer is exactly ``code * step + low`` in float32 arithmetic (4-bit codes, step and
level 0 exact in float16: Q4_0, Q4_1) or ``code * step`` (int8 codes: Q8_0), the row kernel keeps the codes
instead of the floats and rebuilds each weight in registers as that very float32 value before the same FMA chain,
so the results are the float32 kernel's bits while a forward reads ~5 bits a weight (Q4) or ~8.5 (Q8) instead of
32: SmolLM2-135M's linears 92 MiB a forward instead of 513. A check value by value decides, not a flag: a float
checkpoint, or a layer with one group off its grid, keeps float32 weights. Up to 18 rows a tile rebuilds its
weights (cheaper than reading floats at batch 1, the same cost from ~16 rows where the arithmetic dominates), one
tile for all the rows (7 to 12 rows over 2 blocks, 13 to 18 over 1), so each weight is rebuilt once per call: as
6-row tiles plus the rest, 7 rows cost about what 12 did (all linears of the default model, 2 threads: 7 rows
12.6 -> 9.7 ms, 13 rows 20.1 -> 15.0, 17 rows 24.0 -> 18.7; a 16-node tree verifies 17 rows); beyond, each group
of blocks is rebuilt once into float32 slabs that the float32 tiles read.

**AVX2** (no AVX-512): the same kernels over two 8-lane halves per block of 16 outputs (tiles of up to 3 rows x 2
blocks, no one-tile path), for grid weights only, so a GGUF's codes are read there too; float32 weights keep oneDNN,
faster than these tiles at 64 rows. Same operations lane by lane, so the same bits as the AVX-512 form
(tests/test_gguf.py builds it with ``LEAPDECODE_CPU_ISA=avx2`` and compares). Emulated on the Intel VM (built
without AVX-512, oneDNN held to AVX2 by ``ONEDNN_MAX_CPU_ISA=AVX2``; all linears of the default model): 1 row 10.2
ms against oneDNN's 37.6, 5 rows 17.4 / 51.3, 17 rows 36.0 / 66.1, 64 rows 108 / 131, 512 rows 819 / 795;
decoding at batch 1 18 -> 78 tok/s, batch 16 153 -> 261 (benchmarks/README.md). Int8 activations
(``rows_linear_a8``) run there too, through vpmaddubsw instead of VNNI, with the same integer sums and so the same
bits; emulated, all linears 1.6x the codes' float path at 1 row, 2.1x at 5, 1.7x at 512.

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
#include <type_traits>

// One vector holds 16 floats: an AVX-512 register, or two AVX2 halves (the same operations lane by lane, so the
// same bits). RMAX x VMAX is the largest tile and ACC the most accumulators a tile holds, sized to the registers
// (32 of AVX-512, 16 of AVX2); ONE_TILE below. On AVX2 the row kernel serves weights on GGUF grids only (a float32
// one runs oneDNN there: an AVX2 form of the float tiles ran 1.3x slower than oneDNN at 64 rows on the Intel VM,
// with 8 fewer registers and half the width; see rows_wide).
#if defined(__AVX512F__)
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(float a, vec b, vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
static inline vec vfmav(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vsplat(float a) { return _mm512_set1_ps(a); }
static inline vec widen_i8(const int8_t* p) {       // 16 int8 -> float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline vec half16(const at::Half* p) {        // 16 float16 -> float
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void nibbles(const uint8_t* p, vec& lo, vec& hi) {   // 16 bytes -> their low and high nibbles
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static constexpr int RMAX = 6, VMAX = 4, ACC = 24;
static constexpr bool WIDE = true;
#define ROWS_SUPPORTED 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct vec { __m256 a, b; };
static inline vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline vec vfma(float a, vec b, vec c) {
  const __m256 s = _mm256_set1_ps(a);
  return {_mm256_fmadd_ps(s, b.a, c.a), _mm256_fmadd_ps(s, b.b, c.b)};
}
static inline vec vfmav(vec a, vec b, vec c) {
  return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
}
static inline vec vadd(vec a, vec b) { return {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
static inline vec vmul(vec a, vec b) { return {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
static inline vec vsplat(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline __m256 widen8_i8(const void* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline vec widen_i8(const int8_t* p) { return {widen8_i8(p), widen8_i8(p + 8)}; }
static inline vec half16(const at::Half* p) {
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}
static inline void nibbles(const uint8_t* p, vec& lo, vec& hi) {
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
}
static constexpr int RMAX = 3, VMAX = 2, ACC = 6;
static constexpr bool WIDE = false;
#define ROWS_SUPPORTED 1
#endif

bool rows_supported() {
#ifdef ROWS_SUPPORTED
  return true;
#else
  return false;
#endif
}

// The AVX-512 form (every weight kind), not the AVX2 one (grids only: see above).
bool rows_wide() {
#ifdef ROWS_SUPPORTED
  return WIDE;
#else
  return false;
#endif
}

#ifdef ROWS_SUPPORTED
static constexpr int L = 16;         // outputs per block
static constexpr int64_t AHEAD_BYTES = 4096;  // how far ahead in its slab each tile prefetches

// The weight as floats, 16 at a time: a float32 slab as it is, an int8 one widened (its scale comes at the end).
static inline vec wload(const float* p) { return vload(p); }
static inline vec wload(const int8_t* p) { return widen_i8(p); }

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
      vec out = scale ? vmul(acc[r][v], vload(scale + n0 + v * L)) : acc[r][v];
      vstore(y + r * N + n0 + v * L, bias ? vadd(out, vload(bias + n0 + v * L)) : out);
    }
}

// fn.template operator()<R>() for R == M (a tile's rows are a compile-time count; R x VN at most LIMIT, ACC
// accumulators by default)
template <int VN, int LIMIT = ACC, int R = 1, typename F>
static inline void by_rows(int64_t M, F&& fn) {
  if constexpr (R * VN <= LIMIT) {
    if (M == R) {
      fn.template operator()<R>();
      return;
    }
    by_rows<VN, LIMIT, R + 1>(M, fn);
  } else {
    TORCH_CHECK(M == 0, "row kernel: no tile for ", M, " rows over ", VN, " blocks");   // (0: nothing to do)
  }
}

// Steps of RMAX + 1 to ONE_TILE rows over int8 or grid weights take one tile of all their rows over fewer blocks (2
// up to 2 * RMAX rows, else 1): each weight is widened or rebuilt from its codes once for all the rows, not once per
// RMAX-row tile (as 6-row tiles plus the rest, 7 rows cost about what 12 did). fn.template operator()<R, VN>(v):
// the tile of all R == M rows over blocks v .. v+VN-1.
static constexpr int64_t ONE_TILE = WIDE ? 18 : RMAX;       // (AVX2: none; its registers hold 3 x 2 tiles)
template <int V, typename F>
static inline void narrow_tiles(int64_t M, F&& fn) {
  for (int v = 0; v < V;) {
    if (M <= 2 * RMAX && v + 2 <= V) {
      by_rows<2>(M, [&]<int R>() { fn.template operator()<R, 2>(v); });
      v += 2;
    } else {
      by_rows<1>(M, [&]<int R>() { fn.template operator()<R, 1>(v); });
      v += 1;
    }
  }
}

template <int V, typename W>
static void blocks(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t n0,
                   const float* scale, const float* bias) {
  // int8 slabs are widened per tile: one tile for all the rows (float32 ones have nothing to rebuild, and one tile
  // of 13-17 rows measured 0.9x their 6-row tiles)
  if constexpr (!std::is_same<W, float>::value) {
    if (M > RMAX && M <= ONE_TILE) {
      narrow_tiles<V>(M, [&]<int R, int VN>(int v) {
        tile<R, VN>(x, K, w + v * K * L, y, N, n0 + v * L, scale, bias);
      });
      return;
    }
  }
  int64_t m = 0;
  for (; m + RMAX <= M; m += RMAX) tile<RMAX, V>(x + m * K, K, w, y + m * N, N, n0, scale, bias);
  const float* xm = x + m * K;          // the rest in one tile (each pass re-reads the slabs from the cache)
  float* ym = y + m * N;
  by_rows<V>(M - m, [&]<int R>() { tile<R, V>(xm, K, w, ym, N, n0, scale, bias); });
}

// fn.template operator()<V>(b) for every group of V blocks of 16 outputs from block b, the groups spread over the
// threads: how the row kernel walks a weight. Groups of VMAX blocks, or of fewer where that spreads the blocks more
// evenly over the threads (576 outputs, 36 blocks: 9 groups of 4 split 5 / 4 over two threads, one waiting a fifth
// of the time; 12 groups of 3 split 6 / 6); the last group may be shorter. Results do not depend on the grouping:
// each output is one FMA chain over the inputs whichever tile computes it.
template <int V, typename F>
static void over_groups_of(int64_t nb, F& fn) {
  at::parallel_for(0, (nb + V - 1) / V, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * V, v = std::min<int64_t>(V, nb - b);
      if (v == V) fn.template operator()<V>(b);
      else if (v == 3) fn.template operator()<3>(b);
      else if (v == 2) fn.template operator()<2>(b);
      else fn.template operator()<1>(b);
    }
  });
}

template <typename F>
static void over_block_groups(int64_t nb, F&& fn) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int best = VMAX;
  int64_t least = -1;
  for (int v = VMAX; v >= 2; --v) {       // blocks on the busiest thread, groups split as parallel_for splits them
    const int64_t groups = (nb + v - 1) / v, load = std::min<int64_t>((groups + threads - 1) / threads * v, nb);
    if (least < 0 || load < least) least = load, best = v;
  }
  if (best == VMAX) over_groups_of<VMAX>(nb, fn);
  else if (best == 3) over_groups_of<3>(nb, fn);
  else over_groups_of<2>(nb, fn);
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
  over_block_groups(nb, [&]<int V>(int64_t b) { blocks<V>(xp, M, K, wp + b * K * L, yp, N, b * L, scale, bias); });
  return y;
}

// Weights that sit exactly on a grid per group of GRID inputs and output, rebuilt in registers as the very float32
// values a dense copy holds, then multiplied by the same FMA chain: the results are the float32 kernel's bits.
// Q4: a 4-bit code per weight, two inputs a byte (input 2i low nibble, 2i+1 high), codes [N/16, K/2, 16]; a
// (step, low) pair per group and output in float16, params [N/16, K/GRID, 2, 16]: w = code * step + low (one
// rounding, as code * step is exact). Q8: an int8 code per weight, codes [N/16, K, 16]; a float16 step per group
// and output, params [N/16, K/GRID, 16]: w = code * step (exact).
static constexpr int64_t GRID = 32;

struct Q4 {
  const uint8_t* c;
  const at::Half* p;
  int64_t K;
  static constexpr int64_t AHEAD = AHEAD_BYTES / L;             // input pairs (16 bytes a block each)
  Q4 at(int64_t block) const { return {c + block * (K / 2) * L, p + block * (K / GRID) * 2 * L, K}; }
  // the v-th block's (step, level 0) for the group of input k
  inline void group(int v, int64_t k, vec& step, vec& low) const {
    const at::Half* pv = p + v * (K / GRID) * 2 * L + (k / GRID) * 2 * L;
    step = half16(pv);
    low = half16(pv + L);
  }
  // the weights of inputs k and k + 1 (k even) of the v-th block, from its group's (step, low)
  inline void pair(int v, int64_t k, const vec& step, const vec& low, vec& w0, vec& w1) const {
    const uint8_t* cv = c + v * (K / 2) * L + (k / 2) * L;
    _mm_prefetch(reinterpret_cast<const char*>(cv + AHEAD * L), _MM_HINT_T0);
    vec lo, hi;
    nibbles(cv, lo, hi);
    w0 = vfmav(lo, step, low);
    w1 = vfmav(hi, step, low);
  }
};

struct Q8 {
  const int8_t* c;
  const at::Half* p;
  int64_t K;
  static constexpr int64_t AHEAD = AHEAD_BYTES / (2 * L);       // input pairs (32 bytes a block each)
  Q8 at(int64_t block) const { return {c + block * K * L, p + block * (K / GRID) * L, K}; }
  inline void group(int v, int64_t k, vec& step, vec&) const { step = half16(p + v * (K / GRID) * L + (k / GRID) * L); }
  inline void pair(int v, int64_t k, const vec& step, const vec&, vec& w0, vec& w1) const {
    const int8_t* cv = c + v * K * L + k * L;
    _mm_prefetch(reinterpret_cast<const char*>(cv + AHEAD * 2 * L), _MM_HINT_T0);
    w0 = vmul(wload(cv), step);
    w1 = vmul(wload(cv + L), step);
  }
};

// Up to ONE_TILE rows the weights are rebuilt in registers for every tile (one, see narrow_tiles), then the float32
// kernel's FMA chain; beyond, once into float32 slabs that the float32 tiles then read (measured on the 2-core Intel
// VM, all linears of SmolLM2-135M: rebuilding per tile is cheaper up to ~18 rows).
template <int R, int V, typename Grid>
static inline void grid_tile(const float* __restrict x, int64_t K, const Grid& w, float* __restrict y, int64_t N,
                             int64_t n0, const float* bias) {
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t g = 0; g < K; g += GRID) {
    vec step[V], low[V];               // a group's parameters, converted once for its 16 pairs of inputs
    for (int v = 0; v < V; ++v) w.group(v, g, step[v], low[v]);
    for (int64_t k = g; k < g + GRID; k += 2)
      for (int v = 0; v < V; ++v) {
        vec w0, w1;
        w.pair(v, k, step[v], low[v], w0, w1);
        for (int r = 0; r < R; ++r) {
          acc[r][v] = vfma(x[r * K + k], w0, acc[r][v]);
          acc[r][v] = vfma(x[r * K + k + 1], w1, acc[r][v]);
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      vstore(y + r * N + n0 + v * L, bias ? vadd(acc[r][v], vload(bias + n0 + v * L)) : acc[r][v]);
}

template <int V, typename Grid>
static void grid_blocks(const float* x, int64_t M, int64_t K, const Grid& w, float* buf, float* y, int64_t N,
                        int64_t n0, const float* bias) {
  if (M > ONE_TILE) {
    for (int v = 0; v < V; ++v)
      for (int64_t k = 0; k < K; k += 2) {
        vec step, low, w0, w1;
        w.group(v, k, step, low);
        w.pair(v, k, step, low, w0, w1);
        vstore(buf + (v * K + k) * L, w0);
        vstore(buf + (v * K + k + 1) * L, w1);
      }
    blocks<V>(x, M, K, static_cast<const float*>(buf), y, N, n0, nullptr, bias);
    return;
  }
  if (M <= RMAX) {
    by_rows<V>(M, [&]<int R>() { grid_tile<R, V>(x, K, w, y, N, n0, bias); });
    return;
  }
  narrow_tiles<V>(M, [&]<int R, int VN>(int v) { grid_tile<R, VN>(x, K, w.at(v), y, N, n0 + v * L, bias); });
}

// A thread's float32 slabs for rebuilt weights (kept for the next call: at most VMAX blocks of the widest layer).
static float* slabs(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

template <typename Grid>
static torch::Tensor run_grid(const torch::Tensor& x, const Grid& w, int64_t nb, const float* bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) == w.K,
              "rows_linear_grid: x");
  const int64_t M = x.size(0), K = x.size(1), N = nb * L;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  pybind11::gil_scoped_release free_python;
  over_block_groups(nb, [&]<int V>(int64_t b) {
    float* buf = M > ONE_TILE ? slabs(VMAX * K * L) : nullptr;
    grid_blocks<V>(xp, M, K, w.at(b), buf, yp, N, b * L, bias);
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
  TORCH_CHECK(false, "rows_linear: this CPU has no AVX-512 or AVX2");
  return x;
#endif
}

// The same with a weight on exact grids (codes uint8: Q4, int8: Q8; params float16, see Q4 and Q8 above).
torch::Tensor rows_linear_grid(torch::Tensor x, torch::Tensor codes, torch::Tensor params, torch::Tensor bias) {
#ifdef ROWS_SUPPORTED
  const int64_t nb = codes.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == L && codes.is_contiguous() && K % GRID == 0 &&
              params.scalar_type() == torch::kHalf && params.is_contiguous(), "rows_linear_grid: codes, params");
  const float* b = optional(bias, nb * L, "rows_linear_grid: bias");
  if (codes.scalar_type() == torch::kUInt8) {
    TORCH_CHECK(codes.size(1) * 2 == K && params.numel() == nb * (K / GRID) * 2 * L, "rows_linear_grid: q4 shapes");
    return run_grid(x, Q4{codes.data_ptr<uint8_t>(), params.data_ptr<at::Half>(), K}, nb, b);
  }
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.size(1) == K && params.numel() == nb * (K / GRID) * L,
              "rows_linear_grid: q8 shapes");
  return run_grid(x, Q8{codes.data_ptr<int8_t>(), params.data_ptr<at::Half>(), K}, nb, b);
#else
  TORCH_CHECK(false, "rows_linear_grid: this CPU has no AVX-512 or AVX2");
  return x;
#endif
}

// ---- int8 activations on 4- and 8-bit codes (quantization="int8_activations": LOSSY, see a8_form in Python) -----
// Each row's inputs become int8 codes per group of GRID, llama.cpp's Q8_1 blocks: d = max|x| / 127,
// q = round(x * (1 / d)) (to nearest even), s = d * sum(q). A group's product with a 4-bit group (w = code * step
// + low) is then step * d * sum(code * q) + low * s: the integer sum exact in int32 (AVX-512 VNNI: 64 products an
// instruction, where the float kernel does 16), two roundings per group and output, in group order. A row's
// result depends on its own inputs only, never on the rows sharing the call, and any tile computes it with the
// same operations: verification gives a row plain decoding's bits.
// Q4 codes [N/16, K/8, 64]: per block of 16 outputs and chunk of 8 inputs, byte 4j + t holds input 8c + t of output
// j (low nibble) and input 8c + 4 + t (high nibble), so the low and high nibbles of a 64-byte load are dpbusd's
// operands for the chunk's inputs 0-3 and 4-7. Q8 (w = code * step, code -127..127): codes + 128 as bytes [N/16,
// K/4, 64], byte 4j + t input 4c + t of output j, and low = -128 * step (exact): the same sum with the 128 * sum(q)
// the offset adds taken out by the level term.
// The instruction set's pieces: a chunk of codes (16 outputs x 4 inputs, as the 64-byte layout holds them), the
// integer sums of a group, dot4 (a chunk times 4 inputs of a row, added in), and the sums as 16 floats.
#if defined(ROWS_SUPPORTED) && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define A8_SUPPORTED 1
// AVX-512 VNNI: one register a chunk; dpbusd multiplies unsigned codes by signed inputs, four a lane, into int32.
typedef __m512i codes16;
typedef __m512i sums16;
static inline sums16 sums_zero() { return _mm512_setzero_si512(); }
static inline void chunk_q4(const uint8_t* p, codes16& w0, codes16& w1) {
  const __m512i raw = _mm512_loadu_si512(p), nibble = _mm512_set1_epi8(15);
  w0 = _mm512_and_si512(raw, nibble);
  w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
}
static inline void chunk_q8(const uint8_t* p, codes16& w0, codes16& w1) {
  w0 = _mm512_loadu_si512(p);
  w1 = _mm512_loadu_si512(p + 64);
}
template <int BITS>
static inline sums16 dot4(sums16 acc, const codes16& w, int32_t x4) {
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
}
template <int BITS>
static inline vec sums_float(const sums16& acc, int32_t) { return _mm512_cvtepi32_ps(acc); }
static void a8_quantize_group(const float* xg, int8_t* q, float& d, float& s, int32_t& qs) {
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float dg = amax / 127.0f, inv = dg != 0.0f ? 1.0f / dg : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  qs = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  d = dg;
  s = dg * static_cast<float>(qs);
}
static constexpr int A8_ACC = 12, A8_NARROW = 3, A8_RMAX = 6, A8_PAIR = 2;   // tiles: R x V <= A8_ACC (by_rows)
#elif defined(ROWS_SUPPORTED) && defined(__AVX2__)
#define A8_SUPPORTED 1
// AVX2: a chunk's two 8-output halves in two registers. vpmaddubsw adds two unsigned x signed products into int16: a
// Q4 code (<= 15) times an input (|q| <= 127) lets a group's 8 such pairs (30,480) stay in int16 until vpmaddwd
// widens them; a Q8 code is taken signed (byte - 128) with the sign trick (|w| x sign(q, w): one pair is at most
// 32,258) and widened at once, and the 128 x sum(q) that dpbusd's offset codes add is added back at the end. The same
// int32 sums as the AVX-512 form, so the same bits.
struct codes16 { __m256i a, b; };
struct sums16 { __m256i a, b; };
static inline sums16 sums_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline void chunk_q4(const uint8_t* p, codes16& w0, codes16& w1) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  w0 = {_mm256_and_si256(r0, nibble), _mm256_and_si256(r1, nibble)};
  w1 = {_mm256_and_si256(_mm256_srli_epi16(r0, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(r1, 4), nibble)};
}
static inline void chunk_q8(const uint8_t* p, codes16& w0, codes16& w1) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));    // byte - 128, as a signed byte
  auto at = [&](int off) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off)), flip);
  };
  w0 = {at(0), at(32)};
  w1 = {at(64), at(96)};
}
template <int BITS>
static inline __m256i dot4_half(__m256i acc, __m256i w, __m256i x) {
  if constexpr (BITS == 4) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
template <int BITS>
static inline sums16 dot4(sums16 acc, const codes16& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {dot4_half<BITS>(acc.a, w.a, x), dot4_half<BITS>(acc.b, w.b, x)};
}
template <int BITS>
static inline vec sums_float(const sums16& acc, int32_t qs) {
  if constexpr (BITS == 4) {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_cvtepi32_ps(_mm256_madd_epi16(acc.a, one)), _mm256_cvtepi32_ps(_mm256_madd_epi16(acc.b, one))};
  }
  const __m256i off = _mm256_set1_epi32(128 * qs);
  return {_mm256_cvtepi32_ps(_mm256_add_epi32(acc.a, off)), _mm256_cvtepi32_ps(_mm256_add_epi32(acc.b, off))};
}
static void a8_quantize_group(const float* xg, int8_t* q, float& d, float& s, int32_t& qs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[i] = _mm256_loadu_ps(xg + 8 * i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  const float dg = amax / 127.0f, inv = dg != 0.0f ? 1.0f / dg : 0.0f;
  alignas(32) int32_t codes[32];
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i),
                       _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inv))));
  int32_t total = 0;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(codes[i]), total += codes[i];
  qs = total;
  d = dg;
  s = dg * static_cast<float>(total);
}
static constexpr int A8_ACC = 2, A8_NARROW = 1, A8_RMAX = 2, A8_PAIR = 1;
#endif

#ifdef A8_SUPPORTED

// Each row's groups of GRID inputs as int8 codes q, with d, s = d * sum(q) and sum(q) itself (see above).
static void a8_quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s, int32_t* qs) {
  at::parallel_for(0, M * (K / GRID), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) a8_quantize_group(x + i * GRID, q + i * GRID, d[i], s[i], qs[i]);
  });
}

static inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// y[r][n0 + 16v + j] for R rows and V blocks of 16 outputs: per group, the integer sums (dot4), then
// acc = (sum * (step * d)) + acc, acc = (low * s) + acc, each an FMA.
template <int BITS, int R, int V>
static inline void a8_tile(const int8_t* __restrict q, const float* __restrict d, const float* __restrict s,
                           const int32_t* __restrict qs, int64_t K, const uint8_t* __restrict c,
                           const at::Half* __restrict p, float* __restrict y, int64_t N, int64_t n0,
                           const float* bias) {
  const int64_t G = K / GRID, chunks = K * BITS / 32;     // 64-byte chunks a block
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    sums16 sum[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sum[r][v] = sums_zero();
    for (int64_t k = g * GRID; k < (g + 1) * GRID; k += 8)     // inputs k .. k+3 (w0), k+4 .. k+7 (w1)
      for (int v = 0; v < V; ++v) {
        const uint8_t* cv = c + v * chunks * 64 + k * BITS * 2;
        _mm_prefetch(reinterpret_cast<const char*>(cv + AHEAD_BYTES), _MM_HINT_T0);
        codes16 w0, w1;
        if constexpr (BITS == 4) chunk_q4(cv, w0, w1);
        else chunk_q8(cv, w0, w1);
        for (int r = 0; r < R; ++r) {
          const int8_t* qr = q + r * K + k;
          sum[r][v] = dot4<BITS>(sum[r][v], w0, four(qr));
          sum[r][v] = dot4<BITS>(sum[r][v], w1, four(qr + 4));
        }
      }
    for (int v = 0; v < V; ++v) {
      const at::Half* pv = p + (v * G + g) * 2 * L;
      const vec step = half16(pv), low = half16(pv + L);
      for (int r = 0; r < R; ++r) {
        acc[r][v] = vfmav(sums_float<BITS>(sum[r][v], qs[r * G + g]), vmul(step, vsplat(d[r * G + g])), acc[r][v]);
        acc[r][v] = vfmav(low, vsplat(s[r * G + g]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      vstore(y + r * N + n0 + v * L, bias ? vadd(acc[r][v], vload(bias + n0 + v * L)) : acc[r][v]);
}

// Up to A8_NARROW rows: one tile over the group's V blocks; more: tiles of up to A8_RMAX rows over A8_PAIR blocks.
template <int BITS, int V>
static void a8_blocks(const int8_t* q, const float* d, const float* s, const int32_t* qs, int64_t M, int64_t K,
                      const uint8_t* c, const at::Half* p, float* y, int64_t N, int64_t n0, const float* bias) {
  const int64_t G = K / GRID;
  if (M <= A8_NARROW) {
    by_rows<V, A8_ACC>(M, [&]<int R>() { a8_tile<BITS, R, V>(q, d, s, qs, K, c, p, y, N, n0, bias); });
    return;
  }
  for (int v = 0; v < V; v += A8_PAIR) {
    const uint8_t* cv = c + v * (K * BITS / 32) * 64;
    const at::Half* pv = p + v * G * 2 * L;
    for (int64_t m = 0; m < M; m += A8_RMAX) {
      const int64_t rows = std::min<int64_t>(A8_RMAX, M - m);
      auto run = [&]<int VN>() {
        by_rows<VN, A8_ACC>(rows, [&]<int R>() {     // (two accumulators per row and block: A8_ACC tiles)
          a8_tile<BITS, R, VN>(q + m * K, d + m * G, s + m * G, qs + m * G, K, cv, pv, y + m * N, N, n0 + v * L,
                               bias);
        });
      };
      if constexpr (A8_PAIR == 2) {
        if (v + 2 <= V) run.template operator()<2>();
        else run.template operator()<1>();
      } else {
        run.template operator()<1>();
      }
    }
  }
}
#endif

bool a8_supported() {
#ifdef A8_SUPPORTED
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 contiguous; codes uint8 [N/16, K/8, 64] (Q4) or [N/16, K/4, 64] (Q8, see above); params float16
// [N/16, K/32, 2, 16] (step, low); bias [N] or empty. Returns y [M, N].
torch::Tensor rows_linear_a8(torch::Tensor x, torch::Tensor codes, torch::Tensor params, torch::Tensor bias) {
#ifdef A8_SUPPORTED
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "rows_linear_a8: x");
  const int64_t M = x.size(0), K = x.size(1), nb = codes.size(0), N = nb * L, G = K / GRID;
  const bool q4 = codes.size(1) * 8 == K;
  TORCH_CHECK(K % GRID == 0 && codes.scalar_type() == torch::kUInt8 && codes.dim() == 3
              && (q4 || codes.size(1) * 4 == K) && codes.size(2) == 4 * L && codes.is_contiguous()
              && params.scalar_type() == torch::kHalf && params.is_contiguous() && params.numel() == nb * G * 2 * L,
              "rows_linear_a8: codes, params");
  const float* b = optional(bias, N, "rows_linear_a8: bias");
  auto y = torch::empty({M, N}, x.options());
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> dbuf, sbuf;
  thread_local std::vector<int32_t> qsbuf;
  if (static_cast<int64_t>(qbuf.size()) < M * K) qbuf.resize(M * K);
  if (static_cast<int64_t>(dbuf.size()) < M * G) dbuf.resize(M * G), sbuf.resize(M * G), qsbuf.resize(M * G);
  int8_t* q = qbuf.data();
  float* d = dbuf.data();
  float* s = sbuf.data();
  int32_t* qs = qsbuf.data();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const at::Half* pp = params.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  pybind11::gil_scoped_release free_python;
  a8_quantize(x.data_ptr<float>(), M, K, q, d, s, qs);
  over_block_groups(nb, [&]<int V>(int64_t blk) {
    if (q4) a8_blocks<4, V>(q, d, s, qs, M, K, cp + blk * (K / 8) * 64, pp + blk * G * 2 * L, yp, N, blk * L, b);
    else a8_blocks<8, V>(q, d, s, qs, M, K, cp + blk * (K / 4) * 64, pp + blk * G * 2 * L, yp, N, blk * L, b);
  });
  return y;
#else
  TORCH_CHECK(false, "rows_linear_a8: this CPU has neither AVX-512 VNNI nor AVX2");
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
  TORCH_CHECK(false, "rows_linear_int8: this CPU has no AVX-512 or AVX2");
  return x;
#endif
}
"""

BLOCK = 16    # output features per packed block of the row kernel
ABSENT = torch.empty(0)   # the row kernel's absent bias or scale (read only)


@functools.lru_cache(maxsize=1)
def _build_rows():
    """The compiled row kernel, or None where it does not build or this CPU has neither AVX-512 nor AVX2."""
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
    """[N, K] -> [N/16, K, 16]: each block of 16 output features as one contiguous [K, 16] slab (dtype kept; also a
    grid form's parameters [N, K/32] -> [N/16, K/32, 16])."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight of :func:`pack_rows`' blocks (a copy)."""
    nb, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(nb * BLOCK, k).clone()


GROUP = 32    # inputs per group of the row kernel's exact grids (the block size of GGUF's 4- and 8-bit formats)


def grid_form(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The row kernel's codes and parameters for a weight [N, K] that sits exactly on grids, else None.

    Q4 where every group of 32 inputs of an output holds values ``low + code * step`` (code 0..15) that the float32
    arithmetic ``code * step + low`` gives back bit for bit, with ``step`` and ``low`` exact in float16: what a
    4-bit GGUF block (Q4_0, Q4_1) is once dequantized (``low``: the block's minimum, or -8 steps of a step that may
    be negative; a -0.0 rebuilt as 0.0 adds the same to every sum). Else Q8 where every group is ``code * step``
    with an int8 code and a float16 step (Q8_0). Anything else (float checkpoints, K-quants' sub-scales, N or K off
    the kernel's multiples) has no exact grid form. Checked value by value, so a form is only ever a cheaper way to
    read the very same weights."""
    from leapdecode.model.int4_linear import grid_codes
    n, k = weight.shape
    if n % BLOCK or k % GROUP or weight.dtype != torch.float32:
        return None
    w = weight.detach().reshape(n, k // GROUP, GROUP)

    def exact16(t: torch.Tensor) -> bool:
        return bool(torch.isfinite(t).all() and (t.half().float() == t).all())

    sample = w.reshape(-1, GROUP)[:256].sort(-1).values      # a float checkpoint fails here, before any full pass
    if bool(((sample.diff(dim=-1) != 0).sum(-1) < 16).all()):
        # (step, level 0): Q4_1's (span / 15, block minimum); else from the grid's own step (Q4_0, sparse levels):
        # Q4_0's (scale, -8 scales), its scale maybe negative
        low = w.amin(-1)
        step = (w.amax(-1) - low) / 15
        codes, ok = _fit(w, step, low)
        if not bool(ok.all()):
            _, grid_step, _, _ = grid_codes(weight)
            for st, lo in ((grid_step, low), (grid_step, -8 * grid_step), (-grid_step, 8 * grid_step)):
                c, good = _fit(w, st, lo)
                take = ~ok & good
                step, low = torch.where(take, st, step), torch.where(take, lo, low)
                codes, ok = torch.where(take[..., None], c, codes), ok | good
                if bool(ok.all()):
                    break
        if exact16(step) and bool(ok.all()):
            c = pack_rows(codes.reshape(n, k).to(torch.uint8))                  # [N/16, K, 16]
            pairs = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()                # [N/16, K/2, 16]
            params = torch.stack([pack_rows(step), pack_rows(low)], 2)          # [N/16, K/32, 2, 16]
            return pairs, params.half().contiguous()
    step = w.abs().amax(-1) / 127
    if not exact16(step):
        return None
    q = (w / torch.where(step > 0, step, torch.ones_like(step))[..., None]).round().clamp(-127, 127)
    if not torch.equal(q * step[..., None], w):
        return None
    return pack_rows(q.reshape(n, k).to(torch.int8)), pack_rows(step).half()


def _fit(w: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 0..15 of ``w`` [N, K/32, 32] on the grids ``low + code * step`` [N, K/32], and per group whether
    ``code * step + low`` gives every value back bit for bit with ``low`` exact in float16."""
    safe = torch.where(step != 0, step, torch.ones_like(step))[..., None]
    codes = ((w - low[..., None]) / safe).round().clamp(0, 15)
    good = (low.half().float() == low) & (codes * step[..., None] + low[..., None] == w).all(-1)
    return codes, good


def grid_weight(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The dense float32 weight [N, K] of :func:`grid_form`'s codes and parameters (a copy, exact)."""
    if codes.dtype == torch.uint8:
        c = torch.stack([codes & 15, codes >> 4], 2).flatten(1, 2).float()      # [N/16, K, 16]
        step, low = params[:, :, 0].float(), params[:, :, 1].float()            # [N/16, K/32, 16]
    else:
        c, step, low = codes.float(), params.float(), torch.zeros(())
    nb, k, _ = c.shape
    w = c.reshape(nb, k // GROUP, GROUP, BLOCK) * step[:, :, None] + (low[:, :, None] if low.dim() else low)
    return unpack_rows(w.reshape(nb, k, BLOCK))


def a8_form(codes: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A grid form (:func:`grid_form`) laid out for ``rows_linear_a8``. Q4 codes [N/16, K/2, 16] (two inputs a byte)
    -> [N/16, K/8, 64]: per chunk of 8 inputs, byte 4j + t holds input t of output j in its low nibble and input 4 + t
    in its high; parameters as they are. Q8 codes [N/16, K, 16] -> code + 128 as bytes [N/16, K/4, 64], byte 4j + t
    input t of a chunk of 4; parameters (step, -128 * step) [N/16, K/32, 2, 16]."""
    nb, rows, _ = codes.shape
    if codes.dtype == torch.uint8:
        c = torch.stack([codes & 15, codes >> 4], 2).reshape(nb, rows // 4, 2, 4, BLOCK)   # [nb, K/8, lo/hi, t, j]
        byte = (c[:, :, 0] | (c[:, :, 1] << 4)).transpose(2, 3)                           # [nb, K/8, j, t]
        return byte.reshape(nb, rows // 4, 4 * BLOCK).contiguous(), params
    byte = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(nb, rows // 4, 4, BLOCK).transpose(2, 3)
    return byte.reshape(nb, rows // 4, 4 * BLOCK).contiguous(), torch.stack([params, params * -128], 2).contiguous()


def a8_grid(codes: torch.Tensor, params: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`a8_form`."""
    nb, chunks, _ = codes.shape
    byte = codes.reshape(nb, chunks, BLOCK, 4).transpose(2, 3)                           # [nb, chunks, t, j]
    if chunks * 8 == in_features:
        c = torch.stack([byte & 15, byte >> 4], 2).reshape(nb, chunks * 8, BLOCK)        # inputs in order
        return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous(), params
    return (byte.reshape(nb, chunks * 4, BLOCK).to(torch.int16) - 128).to(torch.int8), params[:, :, 0].contiguous()


def float_rows():
    """The row kernel where it also serves float32 weights here (its AVX-512 form), else None (AVX2: oneDNN)."""
    mod = rows_kernel()
    return mod if mod is not None and mod.rows_wide() else None


@functools.lru_cache(maxsize=1)
def a8_kernel():
    """The row kernel where it also runs int8 activations on grid codes here (AVX-512 VNNI or AVX2), else None."""
    mod = rows_kernel()
    return mod if mod is not None and mod.a8_supported() else None


ACTIVATIONS = ("float32", "int8")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed once: the row kernel's blocks where it runs here (and N is a multiple of 16),
    else oneDNN's layout (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, grids: bool = True,
                 activations: str = "float32") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = "rows" if self.out_features % BLOCK == 0 and rows_kernel() is not None else "oneDNN"
        self.params = ABSENT          # a grid form's steps (and lows), see grid_form
        form = grid_form(weight.detach().float()) if self.kernel == "rows" and grids else None
        if form is None and self.kernel == "rows" and float_rows() is None:
            self.kernel = "oneDNN"         # float32 weights on AVX2: oneDNN is faster there (see _SOURCE)
        if form is not None:
            self.kernel = "rows_q4" if form[0].dtype == torch.uint8 else "rows_q8"
            self.packed, self.params = form
            if activations == "int8" and a8_kernel() is not None:                 # LOSSY: see rows_linear_a8
                self.kernel = self.kernel + "a8"
                self.packed, self.params = a8_form(self.packed, self.params)
        else:
            self.packed = pack_rows(weight.float()) if self.kernel == "rows" else _pack(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight (exact: packing only reorders, grids are exact), for set-up code; not used
        by ``forward``."""
        if self.kernel == "oneDNN":
            return self.packed.to_dense()
        if self.kernel == "rows":
            return unpack_rows(self.packed)
        return grid_weight(*(a8_grid(self.packed, self.params, self.in_features) if self.kernel.endswith("a8")
                             else (self.packed, self.params)))

    def row_parts(self) -> list[torch.Tensor] | None:
        """(weight or codes, grid parameters or absent, bias) as the row kernel takes them, or None under oneDNN."""
        if self.kernel == "oneDNN":
            return None
        return [self.packed, self.params, ABSENT if self.bias is None else self.bias.data]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "oneDNN":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        rows = rows if rows.is_contiguous() else rows.contiguous()
        bias = ABSENT if self.bias is None else self.bias.data
        if self.kernel == "rows":
            y = rows_kernel().rows_linear(rows, self.packed, bias)
        elif self.kernel.endswith("a8"):
            y = rows_kernel().rows_linear_a8(rows, self.packed, self.params, bias)
        else:
            y = rows_kernel().rows_linear_grid(rows, self.packed, self.params, bias)
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


def pack_model(model: nn.Module, enable: bool | None = None, activations: str = "float32") -> int:
    """Pack, in place, the linears of a leapdecode Llama model's layers and its LM head (see the module
    docstring). ``enable``: None = wherever available (not decided by a timing at start-up: the choice changes the
    last bits of results, so it must not depend on a noisy measurement), True = the same, with a ValueError off a
    float32 CPU, False = nothing. ``activations="int8"`` (``quantization="int8_activations"``, LOSSY): the layers'
    and the head's 4- and 8-bit grid weights multiply int8 activations (``rows_linear_a8``); a ValueError where no
    layer can (no 4- or 8-bit GGUF weights, no AVX-512 VNNI or AVX2, packing off). Returns how many weights were
    packed."""
    from leapdecode.model.int8_linear import linear_names, replace_linears
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    head = model.output_head
    param = next(model.parameters())
    if enable is False or getattr(head, "tp", None) is not None and head.tp.size > 1:
        if activations == "int8":
            raise ValueError("quantization='int8_activations' needs packed linears (cpu_packed_linears not False) "
                             "and no tensor parallelism")
        return 0
    if not available(param.dtype, param.device):
        if enable or activations == "int8":
            what = "cpu_packed_linears=True" if enable else "quantization='int8_activations'"
            raise ValueError(f"{what} needs a float32 model on a CPU with PyTorch's oneDNN "
                             f"(got {param.dtype} on {param.device.type})")
        return 0
    names = linear_names(model.layers)
    if not names:
        return 0
    replace_linears(model.layers, names,
                    lambda m: PackedLinear(m.weight, getattr(m, "bias", None), activations=activations))
    if activations == "int8" and not any(str(getattr(m, "kernel", "")).endswith("a8") for m in model.layers.modules()):
        raise ValueError("quantization='int8_activations' runs a 4- or 8-bit GGUF's weights (Q4_0, Q4_1, Q8_0) on a "
                         "CPU with AVX-512 VNNI or AVX2: " + ("this CPU has neither" if a8_kernel() is None
                                                     else "this model has no such layer"))
    if head.packed_logits is not None:          # already given its own form (model/int4_linear.py: bfloat16)
        return len(names)
    head.packed_logits = PackedLinear(head.weight, activations=activations)
    return len(names) + 1


__all__ = ["ABSENT", "ACTIVATIONS", "BLOCK", "GROUP", "PackedLinear", "a8_form", "a8_grid", "a8_kernel",
           "available", "float_rows", "grid_form", "grid_weight", "pack_model", "pack_rows", "rows_kernel",
           "unpack_rows"]
