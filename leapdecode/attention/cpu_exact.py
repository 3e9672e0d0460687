"""Batch-invariant attention over the paged cache on the CPU: a small C++ kernel compiled at first use.

Why: PyTorch's float32 SDPA blocks its work by query length and padded key length, so one query row gets
different last bits as a plain decode, as a row of a verification or beside a padded partner; bfloat16 activations
(``quantization="int4"``) turn those bits into different tokens (model/int4_linear.py). SDPA in float64 hides them
with overwhelming probability but copies every gathered key and value to float64 (0.70-0.73x SDPA's speed at
batch 16). This kernel reads each row's keys straight from the paged cache (no gather copy) in chunks of 64 fixed
key positions, skipping keys no row sees, and merges the chunks in ascending order; every sum has one fixed order.
Within a chunk it works eight keys at a time in vector lanes (GCC's vector extensions, which any x86 or Arm target
lowers to its own registers): key j is always lane j % 8, its dot product is summed over the head in one order and
the eight lanes are reduced in one tree, and the exponential is a polynomial computed the same way in every lane.
A row's result therefore depends on nothing but its query and its visible keys: the same alone, padded, batched or
verifying, by construction. Measured (benchmarks/README.md, "cpu_int4.py"): the kernel alone is 1.7-4x faster than
the scalar one it replaced (16 decode rows over 300 keys, SmolLM2's heads: 684 -> 260 us a layer); whole
``generate`` 1.06x float32 SDPA's speed at batch 1 on 600-1,000-token contexts and 1.29x at batch 16 (1.00x and
1.29x under int4).

Compiled at first use (leapdecode/native.py: g++ and ninja, ``-march=native``, cached under
``TORCH_EXTENSIONS_DIR``, ~20 s the first time); :func:`kernel` returns None where that fails, and the backend
falls back to SDPA (float64 under ``exact="always"``, else float32). Float caches only (float32, bfloat16, float16); quantized and
windowed caches, and long prefill chunks (where SDPA's blocked matrix products win), use the fallback.
"""
from __future__ import annotations

import functools

import torch

from leapdecode import native

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <limits>
#include <vector>

// out[s, m, h, :] = softmax over visible keys j (ascending) of scale * q[s, m, h] . k[j, h / group], times v[j]:
// query row m of sequence s sees key j where mask[s, m, j], and key j of sequence s lives in block table[s, j / bs]
// at offset j % bs.
constexpr int64_t CHUNK = 64;   // keys per task: chunks start at fixed key positions (multiples of CHUNK)
constexpr int W = 8;            // lanes of a vector (GCC's vector extension: AVX, AVX-512's halves, NEON pairs)
constexpr int G = CHUNK / W;    // lane groups of a chunk: key j is always lane j % W of group (j % CHUNK) / W
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef float vf_u __attribute__((vector_size(W * sizeof(float)), aligned(alignof(float))));
typedef int vi __attribute__((vector_size(W * sizeof(int))));

inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_u*>(p) = x; }
inline vf splat(float x) { return vf{} + x; }

#if defined(__clang__)
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, vi{__VA_ARGS__})
#endif

// Pairwise sums of adjacent lanes of x then y: [x0+x1, x2+x3, x4+x5, x6+x7, y0+y1, y2+y3, y4+y5, y6+y7].
inline vf pair_add(vf x, vf y) {
  return SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
}

// The eight lane sums of a[0..7], lane i = sum of a[i]'s lanes, always in the same tree order.
inline vf lane_sums(const vf* a) {
  const vf b0 = pair_add(a[0], a[1]), b1 = pair_add(a[2], a[3]), b2 = pair_add(a[4], a[5]), b3 = pair_add(a[6], a[7]);
  return pair_add(pair_add(b0, b1), pair_add(b2, b3));
}

// exp(x) for -87.3 < x <= 0, else exp(-87.3) (Cody-Waite reduction, Cephes' degree-5 polynomial, ~1 ulp), lane by lane with the same
// operations in every lane, so a value's result never depends on its lane or its neighbours.
inline vf exp_neg(vf x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const vf n = __builtin_convertvector(__builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), vi), vf);
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale_;
  std::memcpy(&scale_, &e, sizeof(vf));
  return p * scale_;
}

// A head row of D floats as DV vectors (the last one zero-padded when W does not divide D).
template <int DT>
struct Head {
  static constexpr int MAXV = DT ? (DT + W - 1) / W : 64;
};

// Two phases. (1) One task per (sequence, chunk of CHUNK keys): per kv head, the chunk's key and value rows (read
// in place from a float32 cache, else converted once); per (query row, head) the scores of the chunk's keys, eight
// keys at a time (key j in lane j % W, its dot product summed over the head in one fixed order), their max, the
// exponentials, their sum and the weighted values. (2) One task per (row, head): the chunks merged in ascending
// order. Every sum has one fixed order and chunk boundaries are fixed key positions, so a row's result depends only
// on its query and its visible keys: not on padding, on how many rows its sequence verifies, or on other
// sequences.
template <typename T, int DT>
void run(const float* q, const T* kc, const T* vc, const int64_t* table, const bool* mask, float* out, int64_t S,
         int64_t M, int64_t H, int64_t Hkv, int64_t D_, int64_t bs, int64_t max_k, int64_t block_stride,
         int64_t table_stride, float scale) {
  constexpr int MAXV = Head<DT>::MAXV;
  const int64_t D = DT ? DT : D_, NB = D / W, DV = (D + W - 1) / W;
  const bool in_place = std::is_same<T, float>::value && D % W == 0;
  const int64_t group = H / Hkv, nc = (max_k + CHUNK - 1) / CHUNK, R = S * M;
  std::vector<float> pm(R * nc * H), pl(R * nc * H), pacc(R * nc * H * D);
  at::parallel_for(0, S * nc, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(in_place ? 0 : 2 * CHUNK * DV * W), zero(DV * W, 0.f), qpad(DV * W, 0.f);
    const float* rows[2][CHUNK];
    bool seen[CHUNK];
    alignas(64) float p[CHUNK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / nc, c = task % nc, j0 = c * CHUNK, n = std::min(max_k, j0 + CHUNK) - j0;
      const int64_t* tab = table + s * table_stride;
      for (int64_t jj = 0; jj < CHUNK; ++jj) {
        seen[jj] = false;
        for (int64_t m = 0; jj < n && m < M && !seen[jj]; ++m) seen[jj] = mask[(s * M + m) * max_k + j0 + jj];
      }
      for (int64_t g = 0; g < Hkv; ++g) {
        for (int pass = 0; pass < 2; ++pass) {
          const T* cache = pass == 0 ? kc : vc;
          for (int64_t jj = 0; jj < CHUNK; ++jj) {
            const int64_t j = j0 + jj;
            if (!seen[jj]) { rows[pass][jj] = zero.data(); continue; }
            const T* src = cache + tab[j / bs] * block_stride + (j % bs) * Hkv * D + g * D;
            if constexpr (std::is_same<T, float>::value) {
              if (in_place) { rows[pass][jj] = src; continue; }
            }
            float* dst = tile.data() + (pass * CHUNK + jj) * DV * W;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
            for (int64_t d = D; d < DV * W; ++d) dst[d] = 0.f;
            rows[pass][jj] = dst;
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          const int64_t r = s * M + m, idx = (r * nc + c) * H;
          const bool* mk = mask + r * max_k + j0;
          alignas(64) int vis[CHUNK];
          bool any[G];
          for (int gi = 0; gi < G; ++gi) any[gi] = false;
          for (int64_t jj = 0; jj < CHUNK; ++jj) {
            vis[jj] = jj < n && mk[jj] ? -1 : 0;
            any[jj / W] = any[jj / W] || vis[jj];
          }
          bool none = true;
          for (int gi = 0; gi < G; ++gi) none = none && !any[gi];
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            float* acc_out = pacc.data() + (idx + h) * D;
            if (none) {
              pm[idx + h] = -std::numeric_limits<float>::infinity();
              pl[idx + h] = 0.f;
              for (int64_t d = 0; d < D; ++d) acc_out[d] = 0.f;
              continue;
            }
            const float* qrow = q + (r * H + h) * D;
            if (D % W) { std::memcpy(qpad.data(), qrow, D * sizeof(float)); qrow = qpad.data(); }
            vf qv[MAXV];
            for (int64_t b = 0; b < DV; ++b) qv[b] = load(qrow + b * W);
            // scores, eight keys at a time; lanes of keys the row does not see become -inf
            vf sc[G];
            const vf ninf = splat(-std::numeric_limits<float>::infinity());
            vf mxv = ninf;
            for (int gi = 0; gi < G; ++gi) {
              if (!any[gi]) { sc[gi] = ninf; continue; }
              vf a[W];
              for (int w = 0; w < W; ++w) {
                const float* k = rows[0][gi * W + w];
                vf t = qv[0] * load(k);
                for (int64_t b = 1; b < DV; ++b) t += qv[b] * load(k + b * W);
                a[w] = t;
              }
              const vi vm = *reinterpret_cast<const vi*>(vis + gi * W);
              sc[gi] = vm ? lane_sums(a) * splat(scale) : ninf;
              mxv = mxv > sc[gi] ? mxv : sc[gi];
            }
            float mx = mxv[0];
            for (int w = 1; w < W; ++w) mx = std::max(mx, mxv[w]);
            // exponentials (0 where unseen) and their sum, lane by lane in chunk order, then the lanes in one tree
            vf lsum = splat(0.f);
            for (int gi = 0; gi < G; ++gi) {
              vf e = splat(0.f);
              if (any[gi]) {
                const vi vm = *reinterpret_cast<const vi*>(vis + gi * W);
                e = exp_neg(sc[gi] - splat(mx));
                e = vm ? e : splat(0.f);
                lsum += e;
              }
              store(p + gi * W, e);
            }
            const vf l1 = SHUFFLE(lsum, lsum, 0, 2, 4, 6, 0, 2, 4, 6) + SHUFFLE(lsum, lsum, 1, 3, 5, 7, 1, 3, 5, 7);
            const float l = (l1[0] + l1[1]) + (l1[2] + l1[3]);
            // weighted values, keys in ascending order
            vf acc[MAXV];
            for (int64_t b = 0; b < DV; ++b) acc[b] = splat(0.f);
            for (int64_t jj = 0; jj < n; ++jj) {
              if (!vis[jj]) continue;
              const vf pj = splat(p[jj]);
              const float* v = rows[1][jj];
              for (int64_t b = 0; b < DV; ++b) acc[b] += pj * load(v + b * W);
            }
            pm[idx + h] = mx;
            pl[idx + h] = l;
            for (int64_t b = 0; b < NB; ++b) store(acc_out + b * W, acc[b]);
            for (int64_t d = NB * W; d < D; ++d) acc_out[d] = acc[NB][d - NB * W];
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
  TORCH_CHECK(D <= Head<0>::MAXV * W, "head size above ", Head<0>::MAXV * W);
  auto out = torch::empty_like(q);
  const int64_t block_stride = bs * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    auto go = [&](auto fn) {
      fn(q.data_ptr<float>(), base, base + nb * block_stride, table.data_ptr<int64_t>(), mask.data_ptr<bool>(),
         out.data_ptr<float>(), S, M, H, Hkv, D, bs, max_k, block_stride, table.size(1), static_cast<float>(scale));
    };
    if (D == 64) go(run<scalar_t, 64>);
    else if (D == 128) go(run<scalar_t, 128>);
    else go(run<scalar_t, 0>);
  });
  return out;
}
"""


@functools.lru_cache(maxsize=1)
def kernel():
    """The compiled ``paged_attention`` function, or None where it cannot be built (no compiler, no ninja,
    ``LEAPDECODE_NO_CPU_KERNELS=1``): see leapdecode/native.py."""
    mod = native.build("cpu_exact", _SOURCE, ["paged_attention"])
    return None if mod is None else mod.paged_attention


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
