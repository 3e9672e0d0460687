"""Batch-invariant attention over the paged cache on the CPU: a small C++ kernel compiled at first use.

Why: PyTorch's float32 SDPA blocks its work by query length and padded key length, so one query row gets
different last bits as a plain decode, as a row of a verification or beside a padded partner; bfloat16 activations
(``quantization="int4"``) turn those bits into different tokens (model/int4_linear.py). SDPA in float64 hides them
with overwhelming probability but copies every gathered key and value to float64 (0.70-0.73x SDPA's speed at
batch 16). This kernel reads each row's keys straight from the paged cache (no gather copy) in chunks of 64 fixed
key positions, skipping masked keys, and merges the chunks in ascending order; every sum has one fixed order. A
row's result therefore depends on nothing but its query and its visible keys: the same alone, padded, batched or
verifying, by construction. Measured (benchmarks/README.md, "cpu_int4.py"), reading float32 rows in place: 1.11x
float32 SDPA's speed at batch 1 on 600-1,000-token contexts and 1.20x at batch 16 (0.97x and 1.16x under int4).

Compiled with ``torch.utils.cpp_extension.load_inline`` (g++ and ninja, ``-march=native``; cached under
``TORCH_EXTENSIONS_DIR`` by source and CPU flags, ~20 s the first time); :func:`kernel` returns None where that
fails, and the backend falls back to SDPA (float64 under ``exact="always"``, else float32). Float caches only (float32, bfloat16, float16); quantized and
windowed caches, and long prefill chunks (where SDPA's blocked matrix products win), use the fallback.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <type_traits>
#include <limits>
#include <vector>

// out[s, m, h, :] = softmax over visible keys j (ascending) of scale * q[s, m, h] . k[j, h / group], times v[j]:
// query row m of sequence s sees key j where mask[s, m, j], and key j of sequence s lives in block table[s, j / bs]
// at offset j % bs.
constexpr int LANES = 16;
constexpr int64_t CHUNK = 64;   // keys per task: chunks start at fixed key positions (multiples of CHUNK)

// A cache row as float32: in place for a float32 cache, else converted into buf.
template <typename T>
inline const float* row_as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t D) {
  float part[LANES] = {0.f};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  for (; d < D; ++d) part[0] += a[d] * b[d];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// Two phases. (1) One task per (sequence, chunk of CHUNK keys), all its query rows and heads: each visible key's
// values for every kv head are read once, contiguously, for all the rows that see it; per (row, head) the chunk's
// max, sum of exponentials and weighted values. (2) One task per (row, head): the chunks merged in ascending
// order. Every sum has a fixed order and chunk boundaries are fixed key positions, so a row's result depends only
// on its query and its visible keys: not on padding, on how many rows its sequence verifies, or on other
// sequences.
template <typename T>
void run(const float* q, const T* kc, const T* vc, const int64_t* table, const bool* mask, float* out, int64_t S,
         int64_t M, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t max_k, int64_t block_stride,
         int64_t table_stride, float scale) {
  const int64_t group = H / Hkv, nc = (max_k + CHUNK - 1) / CHUNK, R = S * M;
  std::vector<float> pm(R * nc * H), pl(R * nc * H), pacc(R * nc * H * D);
  at::parallel_for(0, S * nc, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf(Hkv * D), score(M * H * CHUNK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / nc, c = task % nc, j0 = c * CHUNK, j1 = std::min(max_k, j0 + CHUNK);
      const int64_t* tab = table + s * table_stride;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t idx = ((s * M + m) * nc + c) * H;
        for (int64_t h = 0; h < H; ++h) { pm[idx + h] = -std::numeric_limits<float>::infinity(); pl[idx + h] = 0.f; }
        for (int64_t i = 0; i < H * D; ++i) pacc[idx * D + i] = 0.f;
      }
      for (int pass = 0; pass < 2; ++pass) {
        const T* cache = pass == 0 ? kc : vc;
        for (int64_t j = j0; j < j1; ++j) {
          bool seen = false;
          for (int64_t m = 0; m < M && !seen; ++m) seen = mask[(s * M + m) * max_k + j];
          if (!seen) continue;
          const float* row = row_as_float(cache + tab[j / bs] * block_stride + (j % bs) * Hkv * D, kbuf.data(),
                                          Hkv * D);
          for (int64_t m = 0; m < M; ++m) {
            const int64_t r = s * M + m;
            if (!mask[r * max_k + j]) continue;
            const int64_t idx = (r * nc + c) * H;
            float* sc = score.data() + m * H * CHUNK;
            for (int64_t h = 0; h < H; ++h) {
              if (pass == 0) {
                const float x = dot(q + (r * H + h) * D, row + (h / group) * D, D) * scale;
                sc[h * CHUNK + (j - j0)] = x;
                if (x > pm[idx + h]) pm[idx + h] = x;
              } else {
                const float p = std::exp(sc[h * CHUNK + (j - j0)] - pm[idx + h]);
                pl[idx + h] += p;
                const float* v = row + (h / group) * D;
                float* a = pacc.data() + (idx + h) * D;
                for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
              }
            }
          }
        }
      }
    }
  });
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / H, h = task % H;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, pm[(r * nc + c) * H + h]);
      float total = 0.f;
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t idx = (r * nc + c) * H + h;
        if (pl[idx] == 0.f) continue;                 // no visible key in this chunk
        const float f = std::exp(pm[idx] - mx);
        total += pl[idx] * f;
        const float* a = pacc.data() + idx * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * f;
      }
      float* o = out + (r * H + h) * D;
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    }
  });
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor table, torch::Tensor mask,
                              double scale) {
  // q [S, M, H, D] float32 (M query rows per sequence); kv_cache [2, nb, bs, Hkv, D]; table [S, nblocks] int64;
  // mask [S, M, max_k] bool
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(kv_cache.is_contiguous() && table.is_contiguous() && mask.is_contiguous(), "inputs must be contiguous");
  const int64_t S = q.size(0), M = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t max_k = mask.size(2);
  TORCH_CHECK(kv_cache.size(4) == D && H % Hkv == 0 && mask.size(0) == S && mask.size(1) == M, "shape mismatch");
  auto out = torch::empty_like(q);
  const int64_t block_stride = bs * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    run<scalar_t>(q.data_ptr<float>(), base, base + nb * block_stride, table.data_ptr<int64_t>(),
                  mask.data_ptr<bool>(), out.data_ptr<float>(), S, M, H, Hkv, D, bs, max_k, block_stride,
                  table.size(1), static_cast<float>(scale));
  });
  return out;
}
"""


def _build_key() -> str:
    """The build's cache name: the source and this CPU's instruction-set flags (``-march=native``), so a cache
    shared between machines never hands one machine another's instructions."""
    import hashlib
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1((_SOURCE + flags + torch.__version__).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def kernel():
    """The compiled ``paged_attention`` function, or None where it cannot be built (no compiler, no ninja,
    ``LEAPDECODE_NO_CPU_KERNELS=1``)."""
    if os.environ.get("LEAPDECODE_NO_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = load_inline(name=f"leapdecode_cpu_exact_{_build_key()}", cpp_sources=_SOURCE,
                              functions=["paged_attention"], extra_cflags=["-O3", "-march=native"], verbose=False)
        return mod.paged_attention
    except Exception:       # no toolchain, or a build error: the SDPA fallback serves
        return None


def attend(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """``q`` [B, M, H, D] (a group's padded queries), ``kv_cache`` [2, nb, bs, Hkv, D], ``blocks`` [B, nblocks],
    ``mask`` [B, M, max_k] bool -> [B, M, H, D] float32, or None when the kernel is unavailable."""
    fn = kernel()
    if fn is None:
        return None
    return fn(q.float().contiguous(), kv_cache.contiguous(), blocks.to(torch.int64).contiguous(), mask.contiguous(),
              float(scale))


__all__ = ["attend", "kernel"]
