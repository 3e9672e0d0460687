"""Per-layer top-k sparse decode attention on the CPU (attention/sparse.py's ``per_layer`` rule) in one C++ call.

Why: the rule reads every key to score it but only the chosen values, so at long context it can cost little more
than the scoring half of full attention. Written with torch operations it gathered the whole context into a copy,
ran two matrix products, a softmax, top-k and SDPA, and was 0.6x the speed of full attention through the exact
kernel (attention/cpu_exact.py) at 8k keys: slower than what it replaces. This kernel reads keys in place from the
paged cache (float caches, or fp8 / int8 / int4 ones dequantized row by row by the exact kernel's row sources):

1. per (row, chunk of 64 keys), every KV head at once, so the cache is read in its own order: each query head's
   scaled scores, eight keys at a time in vector lanes, the chunk's maximum, exponentials and their sum;
2. per (row, KV head): each earlier position's score, the attention probability its query group gives it (the
   chunks' exponentials rescaled to each head's maximum over its sum, summed over the group), and the top
   ``chosen`` positions before the window by a radix select on the scores' bits (ties: the earliest positions);
3. per (row, KV head, fixed quarter of the kept positions): the value rows gathered once for the group and each
   head's weights (from pass 1's scores) and weighted sum in ascending position order; the quarters are merged in
   order. (Fixed quarters, not one task per KV head: a row has 3 KV heads here, which left one of two threads
   idle for a third of the pass.)

Every sum has one fixed order, so a row's output depends only on its query and its own context, never on the
threads. At 8k keys on the 2-core VM a sparse layer runs ~1.5x faster than the exact kernel's full attention
(benchmarks/README.md, "sparse_attention.py"): pass 1 streams the keys at full attention's bandwidth, and the
values it skips are what it saves. Lossy (the rule drops positions), opt-in with ``sparse_attention``; compiled
into the CPU kernels module (leapdecode/native.py) beside the exact kernel, whose vector helpers it shares.
"""
from __future__ import annotations

import torch

from leapdecode.attention import cpu_exact

_SOURCE = r"""
// Pass 2's selection: the ``k`` largest of ``score[0 .. n)`` (non-negative floats, so their bits order as unsigned
// integers) as ascending positions appended to ``out``; among equal scores the earliest positions are taken.
static void top_positions(const float* score, int64_t n, int64_t k, std::vector<int32_t>& out) {
  if (k <= 0) return;
  if (k >= n) { for (int64_t j = 0; j < n; ++j) out.push_back(static_cast<int32_t>(j)); return; }
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(score);
  // the bin of the k-th largest by the top 11 bits (sign, exponent and two mantissa bits), then its exact bits among
  // that bin's members
  thread_local std::vector<int32_t> count(2048);
  thread_local std::vector<uint32_t> members;
  std::fill(count.begin(), count.end(), 0);
  for (int64_t j = 0; j < n; ++j) ++count[bits[j] >> 21];
  int64_t above = 0, bin = 2047;
  while (above + count[bin] < k) above += count[bin--];
  members.clear();
  for (int64_t j = 0; j < n; ++j) if ((bits[j] >> 21) == static_cast<uint32_t>(bin)) members.push_back(bits[j]);
  const int64_t need = k - above;                   // taken from this bin, the largest first
  std::nth_element(members.begin(), members.begin() + (need - 1), members.end(), std::greater<uint32_t>());
  const uint32_t threshold = members[need - 1];
  int64_t ties = need;                              // positions at exactly the threshold still to take
  for (uint32_t b : members) ties -= b > threshold;
  for (int64_t j = 0; j < n; ++j) {
    if (bits[j] > threshold || (bits[j] == threshold && ties-- > 0)) out.push_back(static_cast<int32_t>(j));
  }
}

template <typename Src, int DT>
void run_top_k(const Src& src, const float* q, const int64_t* lens, const int64_t* chosen, float* out, int64_t B,
               int64_t H, int64_t Hkv, int64_t D_, int64_t window, float scale) {
  constexpr int MAXV = Head<DT>::MAXV;
  const int64_t D = DT ? DT : D_, DV = (D + W - 1) / W, group = H / Hkv;
  int64_t max_n = 0;
  for (int64_t s = 0; s < B; ++s) max_n = std::max(max_n, lens[s]);
  const int64_t nc = (max_n + CHUNK - 1) / CHUNK, span = nc * CHUNK;
  // per row and head: scores and chunk-relative exponentials [B, H, span]; per chunk: maximum and sum [B, nc, H]
  std::vector<float> logit(B * H * span), expo(B * H * span), cmax(B * nc * H), csum(B * nc * H);
  at::parallel_for(0, B * nc, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(CHUNK * DV * W), zero(DV * W, 0.f), qpad(DV * W, 0.f);
    const float* rows[CHUNK];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / nc, c = task % nc, j0 = c * CHUNK, n = std::min(lens[s], j0 + CHUNK) - j0;
      if (n <= 0) {
        for (int64_t h = 0; h < H; ++h) {
          cmax[(s * nc + c) * H + h] = -std::numeric_limits<float>::infinity();
          csum[(s * nc + c) * H + h] = 0.f;
        }
        continue;
      }
      alignas(64) int vis[CHUNK];
      bool want[CHUNK], any[G];
      for (int64_t jj = 0; jj < CHUNK; ++jj) vis[jj] = (want[jj] = jj < n) ? -1 : 0;
      for (int gi = 0; gi < G; ++gi) any[gi] = gi * W < n;
      for (int64_t g = 0; g < Hkv; ++g) {
        chunk_rows(src, 0, s, 0, j0, g, want, D, DV, tile.data(), zero.data(), rows);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qrow = q + (s * H + h) * D;
          if (D % W) { std::memcpy(qpad.data(), qrow, D * sizeof(float)); qrow = qpad.data(); }
          vf qv[MAXV];
          for (int64_t b = 0; b < DV; ++b) qv[b] = load(qrow + b * W);
          vf sc[G];
          float* lg = logit.data() + (s * H + h) * span + j0;
          score_chunk(qv, DV, rows, vis, any, scale, sc, expo.data() + (s * H + h) * span + j0,
                      cmax[(s * nc + c) * H + h], csum[(s * nc + c) * H + h]);
          for (int gi = 0; gi < G; ++gi) store(lg + gi * W, sc[gi]);
        }
      }
    }
  });
  // (2) per KV head of a row: the probability each earlier position gets from the group (each head's chunk
  // exponentials rescaled to the head's maximum, over its sum), the chosen positions, the window, and each head's
  // largest score among them
  std::vector<std::vector<int32_t>> kept(B * Hkv);
  std::vector<float> kmax(B * H);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(span);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hkv, g = task % Hkv, n = lens[s], cand = std::max<int64_t>(n - window, 0);
      const int64_t ncs = (n + CHUNK - 1) / CHUNK;
      std::fill(score.begin(), score.begin() + cand, 0.f);
      for (int64_t i = 0; i < group; ++i) {
        const int64_t h = g * group + i;
        const float* cm = cmax.data() + s * nc * H + h;
        const float* cl = csum.data() + s * nc * H + h;
        float m = -std::numeric_limits<float>::infinity(), z = 0.f;
        for (int64_t c = 0; c < ncs; ++c) m = std::max(m, cm[c * H]);
        for (int64_t c = 0; c < ncs; ++c) z += cl[c * H] * std::exp(cm[c * H] - m);
        const float* e = expo.data() + (s * H + h) * span;
        for (int64_t c = 0; c * CHUNK < cand; ++c) {
          const float f = z > 0.f ? std::exp(cm[c * H] - m) / z : 0.f;
          for (int64_t j = c * CHUNK; j < std::min(cand, (c + 1) * CHUNK); ++j) score[j] += e[j] * f;
        }
      }
      std::vector<int32_t>& keep = kept[task];
      top_positions(score.data(), cand, chosen[s], keep);
      for (int64_t j = cand; j < n; ++j) keep.push_back(static_cast<int32_t>(j));
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* lg = logit.data() + (s * H + h) * span;
        float m = -std::numeric_limits<float>::infinity();
        for (int32_t j : keep) m = std::max(m, lg[j]);
        kmax[s * H + h] = m;
      }
    }
  });
  // (3) exact attention over the kept positions, in PARTS fixed slices of them (so that a row's few KV heads keep
  // every thread busy; the slices are fixed, so the result does not depend on the threads): per slice the value
  // rows gathered once (read in place or converted) and each head's weighted sum, in ascending position order
  constexpr int64_t PARTS = 4;
  std::vector<float> psum(B * H * PARTS * DV * W), ptotal(B * H * PARTS);
  at::parallel_for(0, B * Hkv * PARTS, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows, weight;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / (Hkv * PARTS), g = task / PARTS % Hkv, part = task % PARTS;
      const std::vector<int32_t>& keep = kept[s * Hkv + g];
      const int64_t K = static_cast<int64_t>(keep.size()), x0 = K * part / PARTS, k = K * (part + 1) / PARTS - x0;
      const int64_t KP = (k + W - 1) / W * W;
      rows.resize(k * DV * W);
      for (int64_t x = 0; x < k; ++x) {
        float* dst = rows.data() + x * DV * W;
        const float* v = src.row(1, s, keep[x0 + x], g, dst);
        if (v != dst) std::memcpy(dst, v, D * sizeof(float));
        for (int64_t d = D; d < DV * W; ++d) dst[d] = 0.f;
      }
      weight.resize(KP);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* lg = logit.data() + (s * H + h) * span;
        for (int64_t x = 0; x < KP; ++x) weight[x] = x < k ? lg[keep[x0 + x]] : kmax[s * H + h];
        vf sum = splat(0.f);
        for (int64_t x = 0; x < KP; x += W) {
          vf e = exp_neg(load(weight.data() + x) - splat(kmax[s * H + h]));
          for (int l = 0; l < W; ++l) if (x + l >= k) e[l] = 0.f;
          store(weight.data() + x, e);
          sum += e;
        }
        vf a[MAXV];                                   // one head at a time: its sums stay in registers
        for (int64_t b = 0; b < DV; ++b) a[b] = splat(0.f);
        for (int64_t x = 0; x < k; ++x) {
          const vf pj = splat(weight[x]);
          const float* v = rows.data() + x * DV * W;
          for (int64_t b = 0; b < DV; ++b) a[b] += pj * load(v + b * W);
        }
        const int64_t at = (s * H + h) * PARTS + part;
        ptotal[at] = lane_total(sum);
        for (int64_t b = 0; b < DV; ++b) store(psum.data() + at * DV * W + b * W, a[b]);
      }
    }
  });
  // the slices merged in order
  for (int64_t r = 0; r < B * H; ++r) {
    float total = 0.f;
    for (int64_t part = 0; part < PARTS; ++part) total += ptotal[r * PARTS + part];
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      float a = 0.f;
      for (int64_t part = 0; part < PARTS; ++part) a += psum[(r * PARTS + part) * DV * W + d];
      out[r * D + d] = a * inv;
    }
  }
}

template <typename Src>
torch::Tensor top_k_dispatch(const Src& src, const torch::Tensor& q, const torch::Tensor& lens,
                             const torch::Tensor& chosen, int64_t Hkv, int64_t window, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3 && q.size(1) % Hkv == 0,
              "q: contiguous float32 [B, H, D]");
  TORCH_CHECK(lens.scalar_type() == torch::kLong && chosen.scalar_type() == torch::kLong && lens.is_contiguous()
              && chosen.is_contiguous() && lens.numel() == q.size(0) && chosen.numel() == q.size(0),
              "lens, chosen: int64 [B]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D <= Head<0>::MAXV * W, "head size above ", Head<0>::MAXV * W);
  auto out = torch::empty_like(q);
  pybind11::gil_scoped_release free_python;
  auto go = [&](auto fn) {
    fn(src, q.data_ptr<float>(), lens.data_ptr<int64_t>(), chosen.data_ptr<int64_t>(), out.data_ptr<float>(), B, H,
       Hkv, D, window, static_cast<float>(scale));
  };
  if (D == 64) go(run_top_k<Src, 64>);
  else if (D == 128) go(run_top_k<Src, 128>);
  else go(run_top_k<Src, 0>);
  return out;
}

torch::Tensor top_k_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor table, torch::Tensor lens,
                              torch::Tensor chosen, int64_t window, double scale) {
  // q [B, H, D] float32, one decode query per row; kv_cache [2, nb, bs, Hkv, D]; table [B, nblocks] int64;
  // lens [B] (keys per row), chosen [B] (positions chosen before the window) int64
  TORCH_CHECK(kv_cache.is_contiguous() && table.is_contiguous() && table.scalar_type() == torch::kLong,
              "the cache and table must be contiguous, the table int64");
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(q.size(-1) == D, "shape mismatch");
  torch::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "top_k_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    Paged<scalar_t> src{base, base + nb * bs * Hkv * D, table.data_ptr<int64_t>(), table.size(1), bs, Hkv, D,
                        bs * Hkv * D};
    out = top_k_dispatch(src, q, lens, chosen, Hkv, window, scale);
  });
  return out;
}

// The same over a quantized cache (the exact kernel's Quant row source; see paged_attention_quantized).
torch::Tensor top_k_attention_quantized(torch::Tensor q, torch::Tensor codes, torch::Tensor kgrid, torch::Tensor vgrid,
                                        torch::Tensor scales, torch::Tensor lut, torch::Tensor salient,
                                        torch::Tensor residual, torch::Tensor window_rows, torch::Tensor wmap,
                                        torch::Tensor table, torch::Tensor lens, torch::Tensor chosen, int64_t window,
                                        double scale) {
  const Quant src = quant_source(q.size(-1), codes, kgrid, vgrid, scales, lut, salient, residual, window_rows, wmap,
                                 table);
  return top_k_dispatch(src, q, lens, chosen, src.Hkv, window, scale);
}
"""


def attend(q: torch.Tensor, kv_cache, blocks: torch.Tensor, window_map: torch.Tensor | None, lens: torch.Tensor,
           chosen: torch.Tensor, window: int, scale: float) -> torch.Tensor | None:
    """``q`` [B, H, D]: one decode query per row over ``lens[b]`` keys of ``blocks`` [B, nblocks]; each KV head
    attends over its top ``chosen[b]`` positions before the last ``window`` and the window -> [B, H, D] float32.
    ``kv_cache``: a float cache layer [2, nb, bs, Hkv, D] or a quantized one that ``cpu_exact.reads``
    (``window_map``: its open blocks' window blocks, or None). None when the kernels are unavailable."""
    mod = cpu_exact.kernel()
    if mod is None:
        return None
    q = q.float().contiguous()
    blocks, lens, chosen = (t.to(torch.int64).contiguous() for t in (blocks, lens, chosen))
    if isinstance(kv_cache, torch.Tensor):
        return mod.top_k_attention(q, kv_cache.contiguous(), blocks, lens, chosen, int(window), float(scale))
    args = cpu_exact.quantized_args(kv_cache, window_map)
    return mod.top_k_attention_quantized(q, *args, blocks, lens, chosen, int(window), float(scale))


__all__ = ["attend"]
