"""Batch-invariant attention over the paged cache on the CPU: a small C++ kernel compiled at first use.

Why: PyTorch's float32 SDPA blocks its work by query length and padded key length, so one query row gets
different last bits as a plain decode, as a row of a verification or beside a padded partner; bfloat16 activations
(``quantization="int4"``) turn those bits into different tokens (model/int4_linear.py). SDPA in float64 hides them
with overwhelming probability but copies every gathered key and value to float64 (0.70-0.73x SDPA's speed at
batch 16). This kernel reads each row's keys straight from the paged cache (no gather copy) in chunks of 64 fixed
key positions, skipping keys no row sees, and merges the chunks in ascending order; every sum has one fixed order.
Within a chunk the keys of one kv head are transposed once (sixteen keys in the lanes of a vector), so a query's
score of a key is one chain of fused multiply-adds over the head's elements in order, sixteen keys at a time, and
its weighted values one chain over the visible keys in order per element; the exponential is a polynomial computed
the same way in every lane, and the fused multiply-adds are written as such (no compiler choice between contracting
and not). Every row runs the same code, so a row's result depends on nothing but its query and its visible keys:
the same alone, padded, batched, verifying or in a prompt chunk, by construction. Measured (benchmarks/README.md,
"cpu_int4.py"): the kernel alone is 1.7-4x faster than the scalar one it replaced (16 decode rows over 300 keys,
SmolLM2's heads: 684 -> 260 us a layer); whole ``generate`` 1.06x float32 SDPA's speed at batch 1 on
600-1,000-token contexts and 1.29x at batch 16 (1.00x and 1.29x under int4). (Those were taken with the kernel's
first form, eight keys in lanes with each dot product summed over the head in lanes and the lanes reduced in a
tree; the transposed form, 2026-12-07, decodes at the same speed and reads prompt chunks and verifications
1.1-1.35x faster; benchmarks/README.md, "The exact kernel transposed".)

Compiled at first use (leapdecode/native.py: g++ and ninja, ``-march=native``, cached under
``TORCH_EXTENSIONS_DIR``; one module with the other CPU kernels, ~70 s the first time on a 2-core machine);
:func:`kernel` returns None where that fails, and the backend falls back to SDPA (float64 under ``exact="always"``,
else float32). It reads float caches (float32, bfloat16, float16) and, through :func:`attend_quantized`, fp8, int8
and int4 caches (kv_cache.py), dequantizing each key and value row as it reads it, with the same arithmetic as
``kv_quant`` (the full-precision window for blocks still open): at 4k / 8k tokens on the real model that made fp8
decoding 3.9x / 5.7x and int8 2.1x / 2.7x faster than dequantizing the gathered blocks before SDPA
(benchmarks/README.md). Where the CPU has AVX2 and F16C a row is decoded eight lanes at a time (bytes, nibbles and
float16 grids converted by the CPU's own instructions, fp8 through a gather from its 256 values; int4's salient
tokens keep the scalar path): at 8k keys that took an int8 layer's attention from 1.7x the float cache's time to
0.8x, since it reads a quarter of the bytes.

Prompt chunks of any length are read by it too, so a prompt's keys, values and first token have the bits its rows
get one at a time: the same whether it ran as one chunk, as many, or mostly from the prefix cache (through SDPA,
float32 or float64, a cached prompt's first token had other last bits, and under int8 activations other tokens in 4
of 6 document prompts). Above 32 rows a sequence's rows go in slabs (``SLAB_FLOATS``), so the per-chunk partial
results (a 2,048-token chunk's are ~150 MB) stay in cache and only the chunks a slab sees are visited: a 2,048-token
chunk from key 0 takes 39 ms a layer (166 ms before the slabs; through the engine's SDPA path 63 ms in float32, 162
in float64, this 2-core VM), and after earlier keys it is 1.04-1.25x float32 SDPA's speed (two runs). So exactness
costs prompts at most ~5% by default (time to the first token of a 7,000-token prompt 1.00x, of 300 new tokens after
a cached 1,792-token conversation 0.95x, of first chunks up to ~2,000 tokens 1.09-1.17x float32 SDPA's; with the
kernel's first, per-key form those were 0.80x, 0.84x and 1.03-1.06x), and under quantization, whose fallback was
float64 SDPA, prompts prefill 1.55-2.2x faster (benchmarks/README.md, "Prompt chunks through the exact kernel too"
and "The exact kernel transposed").
"""
from __future__ import annotations

import functools

import torch

from leapdecode import native
from leapdecode.attention.kv_cache import Fp8Layer, WindowedLayer

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <limits>
#include <vector>
#include <memory>
#include <functional>

// out[s, m, h, :] = softmax over visible keys j (ascending) of scale * q[s, m, h] . k[j, h / group], times v[j]:
// query row m of sequence s sees key j where mask[s, m, j], and key j of sequence s lives in block table[s, j / bs]
// at offset j % bs.
constexpr int64_t CHUNK = 64;   // keys per task: chunks start at fixed key positions (multiples of CHUNK)
constexpr int64_t SLAB_ROWS = 32;           // query rows per sequence up to which all are done in one pass (run)
constexpr int64_t SLAB_FLOATS = 1 << 20;    // else rows in slabs whose partial results take about this many floats
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

// The sum of x's eight lanes, always in the same tree order.
inline float lane_total(vf x) {
  const vf l1 = SHUFFLE(x, x, 0, 2, 4, 6, 0, 2, 4, 6) + SHUFFLE(x, x, 1, 3, 5, 7, 1, 3, 5, 7);
  return (l1[0] + l1[1]) + (l1[2] + l1[3]);
}

// exp(x) for -87.3 < x <= 0, else exp(-87.3) (Cody-Waite reduction, Cephes' degree-5 polynomial, ~1 ulp), lane by lane with the same
// operations in every lane, so a value's result never depends on its lane or its neighbours.
template <typename V, typename VI>
inline V exp_neg_of(V x) {
  const V lo = V{} - 87.3f;
  x = x < lo ? lo : x;
  const V n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI), V);
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale_;
  std::memcpy(&scale_, &e, sizeof(V));
  return p * scale_;
}
inline vf exp_neg(vf x) { return exp_neg_of<vf, vi>(x); }

// A head row of D floats as DV vectors (the last one zero-padded when W does not divide D); MAXV16: as vectors of
// 16 lanes (the exact kernel's).
template <int DT>
struct Head {
  static constexpr int MAXV = DT ? (DT + W - 1) / W : 64;
  static constexpr int MAXV16 = DT ? (DT + 15) / 16 : 32;
};

// Sixteen lanes: the exact kernel's vectors (an AVX-512 register, two AVX ones). Its dot products and weighted sums
// are chains of fused multiply-adds written as such (fma16), so no compiler choice between contracting or not can
// give one call other bits than another.
constexpr int WV = 16;
typedef float v16 __attribute__((vector_size(WV * sizeof(float))));
typedef float v16_u __attribute__((vector_size(WV * sizeof(float)), aligned(alignof(float))));
typedef int vi16 __attribute__((vector_size(WV * sizeof(int))));
inline v16 load16(const float* p) { return *reinterpret_cast<const v16_u*>(p); }
inline void store16(float* p, v16 x) { *reinterpret_cast<v16_u*>(p) = x; }
// (v16{} + x would add a zero: one more instruction, and -0 becomes +0; a broadcast reads x from memory)
inline v16 splat16(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#if defined(__AVX512F__)
#include <immintrin.h>
inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
inline v16 fma16(v16 a, v16 b, v16 c) {
  typedef float h8 __attribute__((vector_size(8 * sizeof(float))));
  h8 ah, al, bh, bl, ch, cl;
  std::memcpy(&al, &a, sizeof al); std::memcpy(&ah, reinterpret_cast<const char*>(&a) + sizeof al, sizeof ah);
  std::memcpy(&bl, &b, sizeof bl); std::memcpy(&bh, reinterpret_cast<const char*>(&b) + sizeof bl, sizeof bh);
  std::memcpy(&cl, &c, sizeof cl); std::memcpy(&ch, reinterpret_cast<const char*>(&c) + sizeof cl, sizeof ch);
  const h8 lo = (h8)_mm256_fmadd_ps((__m256)al, (__m256)bl, (__m256)cl);
  const h8 hi = (h8)_mm256_fmadd_ps((__m256)ah, (__m256)bh, (__m256)ch);
  v16 r;
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
  return r;
}
#else
inline v16 fma16(v16 a, v16 b, v16 c) {
  for (int l = 0; l < WV; ++l) c[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return c;
}
#endif

#if defined(__clang__)
#define SHUFFLE16(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE16(x, y, ...) __builtin_shuffle(x, y, vi16{__VA_ARGS__})
#endif

// r[i][l] <- r[l][i]: a 16 x 16 transpose in four rounds of two-vector shuffles (at stride s, rows i and i + s swap
// their s x s blocks off the diagonal). Data movement only: no value changes.
inline void transpose16(v16* r) {
  for (int i = 0; i < 8; ++i) {
    const v16 a = r[i], b = r[i + 8];
    r[i] = SHUFFLE16(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i + 8] = SHUFFLE16(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 16; ++i) {
    if (i & 4) continue;
    const v16 a = r[i], b = r[i + 4];
    r[i] = SHUFFLE16(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    r[i + 4] = SHUFFLE16(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 16; ++i) {
    if (i & 2) continue;
    const v16 a = r[i], b = r[i + 2];
    r[i] = SHUFFLE16(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[i + 2] = SHUFFLE16(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 16; i += 2) {
    const v16 a = r[i], b = r[i + 1];
    r[i] = SHUFFLE16(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] = SHUFFLE16(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

// The largest of x's sixteen lanes, in every lane (four shuffles and maxima instead of fifteen scalar ones).
inline v16 lane_max16(v16 x) {
  v16 y = SHUFFLE16(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = SHUFFLE16(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = SHUFFLE16(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = SHUFFLE16(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x > y ? x : y;
}

// The sum of x's sixteen lanes, always in the same tree order.
inline float lane_total16(v16 x) {
  const v16 h = SHUFFLE16(x, x, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14)
                + SHUFFLE16(x, x, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = h[l];
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// Two phases. (1) One task per (sequence, chunk of CHUNK keys, kv head): the chunk's key rows of that head
// transposed once (``transpose_keys``: read in place from a float32 cache, else converted first) and its value
// rows; per (query row, head) the scores of the chunk's keys, sixteen keys at a time, each score one chain of
// fused multiply-adds over the head's elements in order (key j in lane j % 16); their max, the exponentials, their
// sum in one tree, and the weighted values, one chain of fused multiply-adds over the visible keys in order per
// element (a kv head's query heads share each key and value read, up to three heads side by side). (2) One task
// per (row, head): the chunks merged in ascending order. Every sum has one fixed order, chunk boundaries are fixed
// key positions and every row runs the same code, so a row's result depends only on its query and its visible
// keys: not on padding, on how many rows its sequence has in the call (a decode, a verification, a prompt chunk)
// or on other sequences.
// Where a key's or value's row comes from: ``row(pass, s, j, g, dst)`` (pass 0 keys, 1 values; sequence s, key j,
// kv head g) returns a pointer to its D floats, in the cache itself where they are float32 and D % 16 == 0, else
// written into ``dst`` (converted, or dequantized).

// Key j's block and offset for a block size bs: a shift and a mask where bs is a power of two (the engine's 16)
// rather than a 64-bit division for every key row read (~6% of the kernel's time at batch 1 on the default model).
inline int64_t block_of(int64_t j, int64_t bs) { return (bs & (bs - 1)) == 0 ? j >> __builtin_ctzll(bs) : j / bs; }
inline int64_t offset_of(int64_t j, int64_t bs) { return (bs & (bs - 1)) == 0 ? j & (bs - 1) : j % bs; }

// A paged cache of the model's dtype: [2, nb, bs, Hkv, D]. ``table`` is a block table [S, nblocks], or with
// ``ctx`` each query row's own cache slot per key [S * M, max_k] (a token tree's node: its context, then its
// ancestors), the first ctx[s] keys the same for every row of sequence s.
template <typename T>
struct Paged {
  const T *kc, *vc;
  const int64_t* table;
  int64_t table_stride, bs, Hkv, D, block_stride;
  const int64_t* ctx = nullptr;
  int64_t M = 1;
  // whether the rows of sequence s read different keys in the chunk from key j0 on (then each row loads its own)
  bool divergent(int64_t s, int64_t j0) const { return ctx != nullptr && j0 + CHUNK > ctx[s]; }
  const float* row(int pass, int64_t s, int64_t j, int64_t g, float* dst) const {
    return row_of(pass, s, 0, j, g, dst);
  }
  const float* row_of(int pass, int64_t s, int64_t m, int64_t j, int64_t g, float* dst) const {
    const int64_t at = ctx ? table[(s * M + m) * table_stride + j] * Hkv * D
                           : table[s * table_stride + block_of(j, bs)] * block_stride + offset_of(j, bs) * Hkv * D;
    const T* src = (pass == 0 ? kc : vc) + at + g * D;
    if constexpr (std::is_same<T, float>::value) {
      if (D % WV == 0) return src;
    }
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
    return dst;
  }
};

// A quantized cache (attention/kv_cache.py), codes [2, nb, bs, Hkv, D * bits / 8]: fp8 with a float16 scale per
// (token, head), scales [2, nb, bs, Hkv], decoded through ``lut`` (the 256 e4m3 values); or int8 / int4 on a grid
// z + s * u, keys per (block, head, channel) kgrid [nb, 2, Hkv, D], values per (block, token, head) vgrid
// [nb, 2, bs, Hkv]; int4 stores u / 17 as nibbles (even channel low), except a block's ``ns`` salient tokens per
// head (salient [nb, ns, Hkv] offsets), whose nibble is u's high one and residual [2, nb, ns, Hkv, D / 2] its low
// one. Blocks still open live in a float32 window [2, nw, bs, Hkv, D]: wmap [S, wmap_stride] names a key block's
// window block, or -1 (read the codes). The products s * u and lut * scale are exact in float32 (at most 19
// significant bits), so a fused multiply-add gives the same value as kv_quant's decode.
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_LANES 1
// Eight lanes of a quantized row, converted by the CPU's own instructions (GCC 12 lowers __builtin_convertvector
// from bytes or halves into one scalar conversion per lane).
inline vf byte_lanes(const uint8_t* p) {
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf nibble_lanes(const uint8_t* p) {      // 4 bytes as 8 nibbles, each byte's low one first
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i n = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts);
  return (vf)_mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(15)));
}
inline vf half_lanes(const at::Half* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vf table_lanes(const float* table, const uint8_t* p) {
  return (vf)_mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 4);
}
#endif

struct Quant {
  bool divergent(int64_t, int64_t) const { return false; }
  const float* row_of(int pass, int64_t s, int64_t, int64_t j, int64_t g, float* dst) const {
    return row(pass, s, j, g, dst);
  }
  const uint8_t *codes, *salient, *residual;
  const at::Half *kgrid, *vgrid, *scales;
  const float *lut, *window;
  const int64_t *table, *wmap;
  int64_t table_stride, wmap_stride, bs, Hkv, D, nb, nw, bits, ns;
  // the grid units of a row: 8-bit codes as they are, 4-bit ones unpacked (salient tokens with their low nibbles)
  const uint8_t* units(int pass, int64_t blk, int64_t off, int64_t g, uint8_t* buf) const {
    if (bits == 8) return codes + (((pass * nb + blk) * bs + off) * Hkv + g) * D;
    const uint8_t* c = codes + (((pass * nb + blk) * bs + off) * Hkv + g) * (D / 2);
    int64_t i = 0;
    while (i < ns && salient[(blk * ns + i) * Hkv + g] != off) ++i;
    if (i < ns) {
      const uint8_t* r = residual + (((pass * nb + blk) * ns + i) * Hkv + g) * (D / 2);
      for (int64_t d = 0; d < D; d += 2) {
        buf[d] = static_cast<uint8_t>((c[d / 2] & 15) * 16 + (r[d / 2] & 15));
        buf[d + 1] = static_cast<uint8_t>((c[d / 2] >> 4) * 16 + (r[d / 2] >> 4));
      }
    } else {
      for (int64_t d = 0; d < D; d += 2) {
        buf[d] = static_cast<uint8_t>((c[d / 2] & 15) * 17);
        buf[d + 1] = static_cast<uint8_t>((c[d / 2] >> 4) * 17);
      }
    }
    return buf;
  }
#ifdef QUANT_LANES
  // ``row``'s decode eight lanes at a time, the same values (each lane's arithmetic is the scalar path's); false
  // where the scalar path must serve (an int4 block's salient token)
  bool lanes(int pass, int64_t blk, int64_t off, int64_t g, float* dst) const {
    const int64_t row_at = ((pass * nb + blk) * bs + off) * Hkv + g;
    if (scales != nullptr) {
      const vf sc = splat(static_cast<float>(scales[row_at]));
      for (int64_t d = 0; d < D; d += W) store(dst + d, table_lanes(lut, codes + row_at * D + d) * sc);
      return true;
    }
    for (int64_t i = 0; bits == 4 && i < ns; ++i) if (salient[(blk * ns + i) * Hkv + g] == off) return false;
    const uint8_t* c = codes + row_at * (bits == 8 ? D : D / 2);
    auto units = [&](int64_t d) { return bits == 8 ? byte_lanes(c + d) : nibble_lanes(c + d / 2) * splat(17.f); };
    if (pass == 0) {
      const at::Half* z = kgrid + (blk * 2 * Hkv + g) * D;
      const at::Half* st = z + Hkv * D;
      for (int64_t d = 0; d < D; d += W) store(dst + d, half_lanes(z + d) + half_lanes(st + d) * units(d));
    } else {
      const vf z = splat(static_cast<float>(vgrid[((blk * 2) * bs + off) * Hkv + g]));
      const vf st = splat(static_cast<float>(vgrid[((blk * 2 + 1) * bs + off) * Hkv + g]));
      for (int64_t d = 0; d < D; d += W) store(dst + d, z + st * units(d));
    }
    return true;
  }
#endif
  const float* row(int pass, int64_t s, int64_t j, int64_t g, float* dst) const {
    const int64_t b = block_of(j, bs), off = offset_of(j, bs);
    if (wmap != nullptr) {
      const int64_t wb = wmap[s * wmap_stride + b];
      if (wb >= 0) {
        const float* src = window + (((pass * nw + wb) * bs + off) * Hkv + g) * D;
        if (D % WV == 0) return src;
        std::memcpy(dst, src, D * sizeof(float));
        return dst;
      }
    }
    const int64_t blk = table[s * table_stride + b];
#ifdef QUANT_LANES
    if (D % W == 0 && lanes(pass, blk, off, g, dst)) return dst;
#endif
    if (scales != nullptr) {
      const uint8_t* c = codes + (((pass * nb + blk) * bs + off) * Hkv + g) * D;
      const float sc = static_cast<float>(scales[((pass * nb + blk) * bs + off) * Hkv + g]);
      for (int64_t d = 0; d < D; ++d) dst[d] = lut[c[d]] * sc;
      return dst;
    }
    uint8_t buf[Head<0>::MAXV * W];
    const uint8_t* c = units(pass, blk, off, g, buf);
    if (pass == 0) {
      const at::Half* z = kgrid + (blk * 2 * Hkv + g) * D;
      const at::Half* st = z + Hkv * D;
      for (int64_t d = 0; d < D; ++d)
        dst[d] = static_cast<float>(z[d]) + static_cast<float>(st[d]) * static_cast<float>(c[d]);
    } else {
      const float z = static_cast<float>(vgrid[((blk * 2) * bs + off) * Hkv + g]);
      const float st = static_cast<float>(vgrid[((blk * 2 + 1) * bs + off) * Hkv + g]);
      for (int64_t d = 0; d < D; ++d) dst[d] = z + st * static_cast<float>(c[d]);
    }
    return dst;
  }
};

// One pass's rows of a chunk (pass 0 keys, 1 values; query row m of sequence s, KV head g), as the kernels read them:
// rows[jj] points at key j0 + jj's D floats (in the cache, or converted into tile and padded with zeros to DV
// vectors), or at ``zero`` where !want[jj].
template <typename Src>
inline void chunk_rows(const Src& src, int pass, int64_t s, int64_t m, int64_t j0, int64_t g, const bool* want,
                       int64_t D, int64_t DV, float* tile, const float* zero, const float** rows) {
  for (int64_t jj = 0; jj < CHUNK; ++jj) {
    if (!want[jj]) { rows[jj] = zero; continue; }
    float* dst = tile + jj * DV * W;
    const float* r = src.row_of(pass, s, m, j0 + jj, g, dst);
    if (r == dst) for (int64_t d = D; d < DV * W; ++d) dst[d] = 0.f;
    rows[jj] = r;
  }
}

// One query head over a chunk of CHUNK keys in the kernel's first, per-key form, kept for the scores of
// attention/cpu_sparse.py, whose bits need only be its own (``rows``: the key rows, each padded to DV vectors;
// vis[jj] != 0 where the row sees key jj; any[gi]: lane group gi holds a visible key): sc = scale * q . k, eight keys
// at a time (key j in lane j % W, its dot product a vector of lane partials over the head, reduced in one tree;
// -inf where unseen), their maximum ``mx``, e = exp(sc - mx) (0 where unseen) and their sum ``l``, lane by lane in
// chunk order, then the lanes in one tree.
inline void score_chunk(const vf* qv, int64_t DV, const float* const* rows, const int* vis, const bool* any,
                        float scale, vf* sc, float* e, float& mx, float& l) {
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  vf mxv = ninf;
  for (int gi = 0; gi < G; ++gi) {
    if (!any[gi]) { sc[gi] = ninf; continue; }
    vf a[W];
    for (int w = 0; w < W; ++w) {
      const float* k = rows[gi * W + w];
      vf t = qv[0] * load(k);
      for (int64_t b = 1; b < DV; ++b) t += qv[b] * load(k + b * W);
      a[w] = t;
    }
    const vi vm = *reinterpret_cast<const vi*>(vis + gi * W);
    sc[gi] = vm ? lane_sums(a) * splat(scale) : ninf;
    mxv = mxv > sc[gi] ? mxv : sc[gi];
  }
  mx = mxv[0];
  for (int w = 1; w < W; ++w) mx = std::max(mx, mxv[w]);
  vf lsum = splat(0.f);
  for (int gi = 0; gi < G; ++gi) {
    vf x = splat(0.f);
    if (any[gi]) {
      const vi vm = *reinterpret_cast<const vi*>(vis + gi * W);
      x = exp_neg(sc[gi] - splat(mx));
      x = vm ? x : splat(0.f);
      lsum += x;
    }
    store(e + gi * W, x);
  }
  l = lane_total(lsum);
}

// The chunk's keys of one kv head transposed, kt[d * CHUNK + jj] = key jj's element d, so that a query's scores of
// sixteen keys are one chain of multiply-adds over d in vector lanes (key j in lane j % 16).
inline void transpose_keys(const float* const* rows, int64_t D, float* kt) {
  if (D % WV == 0) {
    v16 r[WV];
    for (int64_t j0 = 0; j0 < CHUNK; j0 += WV)
      for (int64_t d0 = 0; d0 < D; d0 += WV) {
        for (int i = 0; i < WV; ++i) r[i] = load16(rows[j0 + i] + d0);
        transpose16(r);
        for (int i = 0; i < WV; ++i) store16(kt + (d0 + i) * CHUNK + j0, r[i]);
      }
    return;
  }
  for (int64_t jj = 0; jj < CHUNK; ++jj)
    for (int64_t d = 0; d < D; ++d) kt[d * CHUNK + jj] = rows[jj][d];
}

template <typename Src, int DT>
void run(const Src& src, const float* q, const bool* mask, float* out, int64_t S, int64_t M, int64_t H, int64_t Hkv,
         int64_t D_, int64_t max_k, float scale) {
  constexpr int MAXV = Head<DT>::MAXV16;
  const int64_t D = DT ? DT : D_, NB = D / WV, DV = (D + WV - 1) / WV, DV8 = DV * WV / W;
  const int64_t group = H / Hkv, nc = (max_k + CHUNK - 1) / CHUNK;
  // Rows in slabs of Ms per sequence (all M of them for decodes, verifications and short chunks): each slab's
  // partial results per (row, chunk, head) stay small enough to sit in cache (a 2,048-token prefill chunk's would
  // be ~150 MB, written and read back once per layer), and only the chunks some row of the slab sees are visited.
  // Which slab a row is in changes no sum: a row's partials and their merge are computed as for any other M.
  const int64_t Ms = M <= SLAB_ROWS ? M
                     : std::min(M, std::max(SLAB_ROWS, SLAB_FLOATS / std::max<int64_t>(1, S * nc * H * (D + 2))));
  const int64_t R = S * Ms;
  // every (row, chunk, head) slot the merge reads is written by its task (a chunk a row does not see, as empty)
  std::unique_ptr<float[]> pm(new float[R * nc * H]), pl(new float[R * nc * H]), pacc(new float[R * nc * H * D]);
  for (int64_t m0 = 0; m0 < M; m0 += Ms) {
    const int64_t m1 = std::min(M, m0 + Ms);
    int64_t last = -1;   // the last key a row of the slab sees (rows in reverse: causal rows see the most last)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t m = m1 - 1; m >= m0; --m) {
        const bool* row = mask + (s * M + m) * max_k;
        for (int64_t j = max_k - 1; j > last; --j)
          if (row[j]) { last = j; break; }
      }
    const int64_t ncs = (last + CHUNK) / CHUNK;   // chunks the slab's rows see: 0 .. ncs - 1
    at::parallel_for(0, S * ncs * Hkv, 1, [&](int64_t begin, int64_t end) {   // a task per kv head too (a 440-token
      // context's 7 chunks split 4 / 3 over two threads, its 21 tasks 11 / 10)
      // (the tile is written before it is read: converted rows fill their padding; no zeroing of its 32 KB per call)
      std::unique_ptr<float[]> tile(new float[2 * CHUNK * DV * WV]), transposed(new float[D * CHUNK]);
      float* kt = transposed.get();
      std::vector<float> zero(DV * WV, 0.f), weights(group * CHUNK);
      const float* rows[2][CHUNK];
      bool seen[CHUNK];
      for (int64_t task = begin; task < end; ++task) {
        // chunks in the order 0, last, 1, last - 1, ...: a thread's contiguous run of tasks then holds early and
        // late chunks alike, which causal rows see more and fewer of (a 256-row prompt chunk's first half of tasks
        // was 70% of the work); each task writes its own partials, so the order changes no sum
        const int64_t s = task / (ncs * Hkv), k = task / Hkv % ncs, g = task % Hkv;
        const int64_t c = k % 2 == 0 ? k / 2 : ncs - 1 - k / 2, j0 = c * CHUNK;
        const int64_t n = std::min(max_k, j0 + CHUNK) - j0;
        for (int64_t jj = 0; jj < CHUNK; ++jj) {
          seen[jj] = false;
          for (int64_t m = m0; jj < n && m < m1 && !seen[jj]; ++m) seen[jj] = mask[(s * M + m) * max_k + j0 + jj];
        }
        const bool divergent = src.divergent(s, j0);
        auto load_rows = [&](int64_t m, const bool* want) {
          for (int pass = 0; pass < 2; ++pass)
            chunk_rows(src, pass, s, m, j0, g, want, D, DV8, tile.get() + pass * CHUNK * DV * WV, zero.data(),
                       rows[pass]);
          transpose_keys(rows[0], D, kt);
        };
        if (!divergent) load_rows(0, seen);         // every row of the sequence reads these keys
        for (int64_t m = m0; m < m1; ++m) {
          const int64_t r = s * M + m, idx = ((s * Ms + m - m0) * nc + c) * H;
          const bool* mk = mask + r * max_k + j0;
          alignas(64) int vis[CHUNK];
          if (n == CHUNK) {                            // (branch-free, so the compiler widens it: ~8% of a prompt
            for (int64_t jj = 0; jj < CHUNK; ++jj)     // chunk's time went to this loop)
              vis[jj] = -static_cast<int>(static_cast<unsigned char>(mk[jj]) != 0);
          } else {
            for (int64_t jj = 0; jj < CHUNK; ++jj) vis[jj] = jj < n && mk[jj] ? -1 : 0;
          }
          bool none = true;
          for (int64_t jj = 0; jj < CHUNK; ++jj) none = none && !vis[jj];
          if (none) {                                  // no visible key in this chunk (the merge skips it)
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              pm[idx + h] = -std::numeric_limits<float>::infinity();
              pl[idx + h] = 0.f;
            }
            continue;
          }
          if (divergent) {                             // this row's own keys (a tree node's ancestors)
            bool want[CHUNK];
            for (int64_t jj = 0; jj < CHUNK; ++jj) want[jj] = vis[jj] != 0;
            load_rows(m, want);
          }
          // heads i .. i + NH - 1 of kv head g: their scores (NH x 4 chains over d), weights, and weighted values
          auto heads = [&]<int NH>(int64_t i) {
            constexpr int KG = CHUNK / WV;
            const float* qs[NH];
            for (int j = 0; j < NH; ++j) qs[j] = q + (r * H + g * group + i + j) * D;
            v16 a[NH][KG];
            for (int j = 0; j < NH; ++j)
              for (int kg = 0; kg < KG; ++kg) a[j][kg] = v16{};
            for (int64_t d = 0; d < D; ++d) {
              const float* kd = kt + d * CHUNK;
              for (int j = 0; j < NH; ++j) {
                const v16 qd = splat16(qs[j][d]);
                for (int kg = 0; kg < KG; ++kg) a[j][kg] = fma16(qd, load16(kd + kg * WV), a[j][kg]);
              }
            }
            // the heads' softmax phase by phase, each over all NH x KG vectors, so their latency chains (the
            // maxima's shuffles, the exponentials' polynomials) run side by side
            const v16 ninf = splat16(-std::numeric_limits<float>::infinity());
            vi16 vm[KG];
            for (int kg = 0; kg < KG; ++kg) vm[kg] = *reinterpret_cast<const vi16*>(vis + kg * WV);
            v16 mxs[NH];
            for (int j = 0; j < NH; ++j) {
              v16 mxv = ninf;
              for (int kg = 0; kg < KG; ++kg) {
                a[j][kg] = vm[kg] ? a[j][kg] * scale : ninf;
                mxv = mxv > a[j][kg] ? mxv : a[j][kg];
              }
              mxs[j] = lane_max16(mxv);
            }
            for (int j = 0; j < NH; ++j)
              for (int kg = 0; kg < KG; ++kg) {
                const v16 x = exp_neg_of<v16, vi16>(a[j][kg] - mxs[j]);
                a[j][kg] = vm[kg] ? x : v16{};
                store16(weights.data() + (i + j) * CHUNK + kg * WV, a[j][kg]);
              }
            for (int j = 0; j < NH; ++j) {
              const int64_t h = g * group + i + j;
              pm[idx + h] = mxs[j][0];
              pl[idx + h] = lane_total16((a[j][0] + a[j][1]) + (a[j][2] + a[j][3]));
            }
            v16 acc[NH][MAXV];
            for (int j = 0; j < NH; ++j)
              for (int64_t b = 0; b < DV; ++b) acc[j][b] = v16{};
            for (int64_t jj = 0; jj < n; ++jj) {
              if (!vis[jj]) continue;
              v16 pj[NH];
              for (int j = 0; j < NH; ++j) pj[j] = splat16(weights[(i + j) * CHUNK + jj]);
              const float* v = rows[1][jj];
              for (int64_t b = 0; b < DV; ++b) {
                const v16 vb = load16(v + b * WV);
                for (int j = 0; j < NH; ++j) acc[j][b] = fma16(pj[j], vb, acc[j][b]);
              }
            }
            for (int j = 0; j < NH; ++j) {
              float* acc_out = pacc.get() + (idx + g * group + i + j) * D;
              for (int64_t b = 0; b < NB; ++b) store16(acc_out + b * WV, acc[j][b]);
              for (int64_t d = NB * WV; d < D; ++d) acc_out[d] = acc[j][NB][d - NB * WV];
            }
          };
          for (int64_t i = 0; i < group;) {
            const int64_t left = std::min<int64_t>(group - i, DV <= 8 ? 3 : 1);
            if (left == 3) heads.template operator()<3>(i);
            else if (left == 2) heads.template operator()<2>(i);
            else heads.template operator()<1>(i);
            i += left;
          }
        }
      }
    });
    // the chunks merged per (row, head): on the calling thread where that is little work (a decode or a short
    // verification: a parallel region's fork and join cost more than its few thousand multiply-adds)
    // (chunks past ncs: no row of the slab sees a key there, as if written empty)
    at::parallel_for(0, S * (m1 - m0) * H, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, ncs * D)),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> acc(D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / ((m1 - m0) * H), mm = task / H % (m1 - m0), h = task % H;
        const int64_t p = s * Ms + mm, r = s * M + m0 + mm;   // the row's partials, the row
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < ncs; ++c) mx = std::max(mx, pm[(p * nc + c) * H + h]);
        float total = 0.f;
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
        for (int64_t c = 0; c < ncs; ++c) {
          const int64_t idx = (p * nc + c) * H + h;
          if (pl[idx] == 0.f) continue;                 // no visible key in this chunk
          const float f = std::exp(pm[idx] - mx);
          total += pl[idx] * f;
          const float* a = pacc.get() + idx * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * f;
        }
        float* o = out + (r * H + h) * D;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
      }
    });
  }
}

template <typename Src>
void dispatch(const Src& src, const torch::Tensor& q, const torch::Tensor& mask, torch::Tensor& out, int64_t Hkv,
              double scale) {
  const int64_t S = q.size(0), M = q.size(1), H = q.size(2), D = q.size(3), max_k = mask.size(2);
  pybind11::gil_scoped_release free_python;   // the grammar's mask fill runs in another thread meanwhile
  auto go = [&](auto fn) {
    fn(src, q.data_ptr<float>(), mask.data_ptr<bool>(), out.data_ptr<float>(), S, M, H, Hkv, D, max_k,
       static_cast<float>(scale));
  };
  if (D == 64) go(run<Src, 64>);
  else if (D == 128) go(run<Src, 128>);
  else go(run<Src, 0>);
}

void check(const torch::Tensor& q, const torch::Tensor& table, const torch::Tensor& mask, int64_t Hkv, int64_t D) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(table.is_contiguous() && mask.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.size(3) == D && q.size(2) % Hkv == 0 && mask.size(0) == q.size(0) && mask.size(1) == q.size(1),
              "shape mismatch");
  TORCH_CHECK(D <= Head<0>::MAXV * W, "head size above ", Head<0>::MAXV * W);
}

static torch::Tensor paged(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor table, torch::Tensor mask,
                           double scale, const torch::Tensor* ctx) {
  TORCH_CHECK(kv_cache.is_contiguous(), "the cache must be contiguous");
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3), D = kv_cache.size(4);
  check(q, table, mask, Hkv, D);
  TORCH_CHECK(!ctx || (table.size(0) == q.size(0) * q.size(1) && table.size(1) >= mask.size(2)
                       && ctx->numel() == q.size(0) && ctx->is_contiguous()), "a slot for every row and key");
  auto out = torch::empty_like(q);
  const int64_t block_stride = bs * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    Paged<scalar_t> src{base, base + nb * block_stride, table.data_ptr<int64_t>(), table.size(1), bs, Hkv, D,
                        block_stride};
    if (ctx) { src.ctx = ctx->data_ptr<int64_t>(); src.M = q.size(1); }
    dispatch(src, q, mask, out, Hkv, scale);
  });
  return out;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor table, torch::Tensor mask,
                              double scale) {
  // q [S, M, H, D] float32 (M query rows per sequence); kv_cache [2, nb, bs, Hkv, D]; table [S, nblocks] int64;
  // mask [S, M, max_k] bool
  return paged(q, kv_cache, table, mask, scale, nullptr);
}

// The same with each query row's keys by cache slot, slots [S * M, max_k] int64, the first ctx[s] the same for all
// rows of sequence s (ctx [S] int64): a token tree's node attended as plain decoding would attend it after its path
// (its context, then its ancestors at consecutive key indices), so its sums run in the same lanes and chunks and
// its bits are plain decoding's; the context's chunks are still read once for all the tree's nodes.
torch::Tensor paged_attention_slots(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor ctx,
                                    torch::Tensor mask, double scale) {
  return paged(q, kv_cache, slots, mask, scale, &ctx);
}

// A quantized cache's row source (see Quant) for heads of size D: kgrid and vgrid (int8 / int4) or scales and lut
// (fp8), window and wmap when the cache keeps open blocks at full precision; absent ones are empty tensors.
Quant quant_source(int64_t D, const torch::Tensor& codes, const torch::Tensor& kgrid, const torch::Tensor& vgrid,
                   const torch::Tensor& scales, const torch::Tensor& lut, const torch::Tensor& salient,
                   const torch::Tensor& residual, const torch::Tensor& window, const torch::Tensor& wmap,
                   const torch::Tensor& table) {
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.is_contiguous() && codes.dim() == 5,
              "codes: uint8 [2, nb, bs, h, d]");
  const int64_t nb = codes.size(1), bs = codes.size(2), Hkv = codes.size(3);
  const int64_t bits = codes.size(4) == D ? 8 : 4, ns = salient.numel() ? salient.size(1) : 0;
  TORCH_CHECK(codes.size(4) * 8 / bits == D && D % 2 == 0, "codes: one byte per value, or two values per byte");
  TORCH_CHECK(bits == 8 || scales.numel() == 0, "fp8 codes are one byte per value");
  TORCH_CHECK(ns == 0 || (salient.scalar_type() == torch::kByte && salient.is_contiguous() && residual.is_contiguous()
                          && residual.scalar_type() == torch::kByte && residual.size(2) == ns), "salient tokens");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == torch::kLong, "the block table: contiguous int64");
  const bool fp8 = scales.numel() > 0, windowed = wmap.numel() > 0;
  TORCH_CHECK(fp8 ? (scales.scalar_type() == torch::kHalf && scales.is_contiguous() && lut.numel() == 256 &&
                     lut.scalar_type() == torch::kFloat32)
                  : (kgrid.scalar_type() == torch::kHalf && vgrid.scalar_type() == torch::kHalf &&
                     kgrid.is_contiguous() && vgrid.is_contiguous()), "quantized cache: bad grids or scales");
  TORCH_CHECK(!windowed || (window.scalar_type() == torch::kFloat32 && window.is_contiguous() &&
                            wmap.scalar_type() == torch::kLong && wmap.is_contiguous()), "window: float32, wmap int64");
  return Quant{codes.data_ptr<uint8_t>(), ns ? salient.data_ptr<uint8_t>() : nullptr,
               ns ? residual.data_ptr<uint8_t>() : nullptr,
               fp8 ? nullptr : kgrid.data_ptr<at::Half>(), fp8 ? nullptr : vgrid.data_ptr<at::Half>(),
               fp8 ? scales.data_ptr<at::Half>() : nullptr, fp8 ? lut.data_ptr<float>() : nullptr,
               windowed ? window.data_ptr<float>() : nullptr, table.data_ptr<int64_t>(),
               windowed ? wmap.data_ptr<int64_t>() : nullptr, table.size(1), windowed ? wmap.size(1) : 0, bs, Hkv, D,
               nb, windowed ? window.size(1) : 0, bits, ns};
}

// The exact kernel over a quantized cache (see quant_source).
torch::Tensor paged_attention_quantized(torch::Tensor q, torch::Tensor codes, torch::Tensor kgrid, torch::Tensor vgrid,
                                        torch::Tensor scales, torch::Tensor lut, torch::Tensor salient,
                                        torch::Tensor residual, torch::Tensor window, torch::Tensor wmap,
                                        torch::Tensor table, torch::Tensor mask, double scale) {
  const Quant src = quant_source(q.size(3), codes, kgrid, vgrid, scales, lut, salient, residual, window, wmap, table);
  check(q, table, mask, src.Hkv, src.D);
  auto out = torch::empty_like(q);
  dispatch(src, q, mask, out, src.Hkv, scale);
  return out;
}
"""


def kernel():
    """The compiled module with ``paged_attention``, or None where it cannot be built (no compiler, no ninja,
    ``LEAPDECODE_NO_CPU_KERNELS=1``): see leapdecode/native.py."""
    return native.kernels()


def attend(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """``q`` [B, M, H, D] (a group's padded queries), ``kv_cache`` [2, nb, bs, Hkv, D], ``blocks`` [B, nblocks],
    ``mask`` [B, M, max_k] bool -> [B, M, H, D] float32, or None when the kernel is unavailable."""
    mod = kernel()
    if mod is None:
        return None
    return mod.paged_attention(q.float().contiguous(), kv_cache.contiguous(), blocks.to(torch.int64).contiguous(),
                               mask.contiguous(), float(scale))


def attend_slots(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
                 mask: torch.Tensor, scale: float) -> torch.Tensor | None:
    """:func:`attend` with each query row's keys given by cache slot, ``slots`` [B * max_q, max_k] int64, the first
    ``ctx[b]`` keys the same for every row of sequence b (a tree's nodes: their context, then their ancestors; see
    ``torch_ref._tree_rows``)."""
    mod = kernel()
    if mod is None:
        return None
    return mod.paged_attention_slots(q.float().contiguous(), kv_cache.contiguous(), slots.contiguous(),
                                     ctx.contiguous(), mask.contiguous(), float(scale))


def reads(layer) -> bool:
    """Whether :func:`attend_quantized` reads this quantized cache layer: fp8, or int8 / int4 with a float32
    window."""
    if isinstance(layer, Fp8Layer):
        return layer.codes.device.type == "cpu"
    return (isinstance(layer, WindowedLayer) and layer.codes.device.type == "cpu" and layer.layout.bits in (4, 8)
            and layer.window.dtype == torch.float32)


def attend_quantized(q: torch.Tensor, layer, blocks: torch.Tensor, window: torch.Tensor | None, mask: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """:func:`attend` over a quantized cache layer that :func:`reads` (kv_cache.Fp8Layer or an fp8 / int8 / int4
    WindowedLayer), dequantizing each key and value row as the kernel reads it; ``window`` [B, nblocks]: a block's
    window block while it is open, else -1 (None: no window). None when the kernel is unavailable."""
    mod = kernel()
    if mod is None:
        return None
    return mod.paged_attention_quantized(q.float().contiguous(), *quantized_args(layer, window),
                                         blocks.to(torch.int64).contiguous(), mask.contiguous(), float(scale))


def quantized_args(layer, window: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A quantized cache layer as the kernels' row source takes it: :func:`quantized_tensors`, with its window only
    where ``window`` (a block's window block, or -1) is given, then ``window`` as int64 (empty tensors for what the
    layer does not have)."""
    none = torch.empty(0)
    *tensors, win = quantized_tensors(layer)
    return (*tensors, win if window is not None else none,
            window.to(torch.int64).contiguous() if window is not None else none)


def quantized_tensors(layer) -> tuple[torch.Tensor, ...]:
    """A quantized cache layer's storage as the kernels take it: codes, key and value grids, fp8 scales and their 256
    values, salient tokens and their residual nibbles, the full-precision window (empty tensors for what the layer
    does not have)."""
    none = torch.empty(0)
    fp8 = getattr(layer, "scales", None) is not None
    win = getattr(layer, "window", None)
    salient = getattr(layer, "salient", None)
    salient = salient if salient is not None and layer.layout.num_salient else None
    return (layer.codes, none if fp8 else layer.key_grid, none if fp8 else layer.value_grid,
            layer.scales if fp8 else none, _fp8_values() if fp8 else none,
            none if salient is None else salient, none if salient is None else layer.residual,
            none if win is None else win)


@functools.lru_cache(maxsize=1)
def _fp8_values() -> torch.Tensor:
    """The 256 float8_e4m3fn values by code, as float32."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


__all__ = ["attend", "attend_quantized", "kernel", "quantized_args", "quantized_tensors", "reads"]
