"""A decoder layer in one C++ call, for the CPU's small steps (batch 1 decoding, its verification and its drafts).

Why: at batch 1 a CPU forward of SmolLM2-135M spends ~3.5 ms of its ~22 ms outside the matrix products and the
attention kernel, and an int8 draft forward (spec/layer_skip.py) about a third of its ~10 ms: some 35 PyTorch ops
and a dozen module calls per layer, each a few microseconds of dispatch around a few kilobytes of arithmetic (the
layer loop with every linear and the attention kernel replaced by no-ops: 3.5 ms a forward, measured on the
2-core Intel VM). Here the whole layer - RMSNorm, the fused q/k/v product, the rotary embedding, the cache write,
paged attention, the output product and residual, RMSNorm, gate/up, SiLU-and-multiply, down and residual - is
one call from Python.

Exactness: the call runs the very kernels the layer-by-layer path runs, from the same compiled module
(``native.kernels()`` builds cpu_ops, cpu_exact, packed_linear and this file's source together), PyTorch's own
``silu`` and product, and the cache write and residual adds as plain copies and sums of the same values (without
``index_copy_``'s and ``add``'s dispatch: 1.02-1.07x a layer), on the same inputs in the same order, so its result
is bit-identical to ``DecoderLayer.forward``'s; speculation's losslessness, which rests on a row's bits not
depending on the path that computed it, is kept (tests/test_cpu_layer.py compares the two bit for bit).

When: the attention backend says the step allows it (``AttentionMetadata.cpu_step``, set by ``TorchAttention.plan``:
every attention group of the step is read by the exact kernel - decodes, verifications, short prefill chunks - or,
for sparse decode rows of the per_layer rule, by the top-k kernel from the first selection layer on, with no
sealing; a step of one group whose queries are its tokens in order skips the gather and scatter), the layer's cache
is a plain float32 tensor or a windowed quantized cache the exact kernel reads (int8, int4, fp8 keeping recent
tokens; on steps that seal no block), and the layer is a plain Llama layer whose four products run through the row
kernel (``PackedLinear`` over float32 weights or a GGUF file's codes, or, up to its ``ROWS_MAX`` rows,
``Int8Linear``): no q/k norm, float32 RMSNorm weights. Everything else keeps the module path (long prefill chunks,
steps that seal blocks, fp8 caches without a window, GPUs, oneDNN or F.linear products).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from leapdecode import native
from leapdecode.attention import cpu_exact
from leapdecode.attention.kv_cache import WindowedLayer

_SOURCE = r"""
// ---- model/cpu_layer.py: one decoder layer in one call -------------------------------------------------------
#ifdef ROWS_SUPPORTED
static torch::Tensor layer_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                                  const torch::Tensor& bias) {
  if (scale.scalar_type() == torch::kHalf)
    return w.size(2) == 4 * L ? rows_linear_a8(x, w, scale, bias)     // int8 activations (LOSSY, opt-in)
                              : rows_linear_grid(x, w, scale, bias);  // exact grids
  if (w.scalar_type() == torch::kInt8) return rows_linear_int8(x, w, scale, bias);
  return rows_linear(x, w, bias);
}
#endif

// The step's keys and values [T, Hkv, D] (rows of the fused q/k/v product) into cache slots [T] of flat [2, slots,
// Hkv, D]: index_copy_'s copy, without its dispatch (~3 us a call, two a layer).
static void write_rows(const torch::Tensor& flat, const torch::Tensor& slots, const torch::Tensor& k,
                       const torch::Tensor& v) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), half = flat.stride(0);
  TORCH_CHECK(flat.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 && flat.stride(1) == row
              && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2)
              && slots.scalar_type() == torch::kLong && slots.is_contiguous(), "decoder_layer: kv rows");
  float* base = flat.data_ptr<float>();
  const int64_t* at = slots.data_ptr<int64_t>();
  const int64_t n = flat.size(1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(at[t] >= 0 && at[t] < n, "decoder_layer: slot out of range");
    std::memcpy(base + at[t] * row, k.data_ptr<float>() + t * k.stride(0), row * sizeof(float));
    std::memcpy(base + half + at[t] * row, v.data_ptr<float>() + t * v.stride(0), row * sizeof(float));
  }
}

// y += x (the residual; x + y's values: a float sum does not depend on its order), y fresh from a product
static torch::Tensor add_into(torch::Tensor y, const torch::Tensor& x) {
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && y.numel() == x.numel(), "decoder_layer: residual");
  float* out = y.data_ptr<float>();
  const float* in = x.data_ptr<float>();
  for (int64_t i = 0, n = y.numel(); i < n; ++i) out[i] += in[i];
  return y;
}

// x [T, hidden] float32. w: 0 input norm, 1-3 qkv (weight, scale, bias), 4-6 o, 7 post-attention norm, 8-10
// gate/up, 11-13 down, 14 cos, 15 sin, 16 the layer's cache [2, nb, bs, Hkv, D] (absent scale/bias: empty), or
// for a windowed quantized cache 16-23: codes, key grid, value grid, fp8 scales, their 256 values, salient tokens,
// residual nibbles (absent ones empty) and the float32 window [2, nw, bs, Hkv, D] (see cpu_exact's Quant); then the
// step's slots are window slots (-1: a token of a block that is not open) and each group's key slots its window map.
// step: 0 positions [T], 1 slots [T] int64, then per attention group (TorchAttention's plan) six tensors: query
// rows [B, M], block table [B, nblocks] int64 (a tree group read by slot: its context lengths [B]), key slots
// [B * M, max_k] int64 (a tree group's; else empty), mask [B, M, max_k] bool, output rows, valid queries [B, M]
// (query and output rows empty: the step's tokens in order; valid queries empty: all); a group of sparse decode
// rows (query rows [B]) has int64 [3, B] in the mask's place: keys, chosen positions and window per row (the top-k
// kernel, attention/cpu_sparse.py). p: eps, H, Hkv, D, scale.
// The same operations as DecoderLayer.forward, TorchAttention.write_kv and TorchAttention.attend.
static torch::Tensor layer_forward(torch::Tensor x, const std::vector<torch::Tensor>& w,
                                   const std::vector<torch::Tensor>& step, const std::vector<double>& p) {
#ifdef ROWS_SUPPORTED
  const double eps = p[0], scale = p[4];
  const int64_t H = static_cast<int64_t>(p[1]), Hkv = static_cast<int64_t>(p[2]), D = static_cast<int64_t>(p[3]);
  const int64_t T = x.size(0);
  TORCH_CHECK(step.size() >= 8 && (step.size() - 2) % 6 == 0 && step[1].size(0) == T, "decoder_layer: step");
  auto qkv = layer_linear(rms_norm(x, w[0], eps), w[1], w[2], w[3]);
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rope_(step[0], q, k, w[14], w[15]);
  const bool windowed = w.size() > 17;
  const auto& store = windowed ? w[23] : w[16];
  auto flat = store.view({2, -1, Hkv, D});
  // a windowed cache's tokens of blocks that are not open go to the spare last window block (never read)
  const auto slots = windowed ? torch::where(step[1] >= 0, step[1], (store.size(1) - 1) * store.size(2)) : step[1];
  write_rows(flat, slots, k, v);
  torch::Tensor o;
  if (!windowed && step.size() == 8 && step[2].numel() == 0) {
    o = paged_attention(q.contiguous().view({step[5].size(0), step[5].size(1), H, D}), w[16], step[3], step[5],
                        scale);
  } else {
    o = torch::empty({T, H, D}, x.options());
    for (size_t g = 2; g < step.size(); g += 6) {
      auto qg = q.index({step[g]});
      if (step[g + 3].scalar_type() == torch::kLong) {     // sparse decode rows: each KV head's top positions
        const auto& counts = step[g + 3];
        const auto keys = counts[0].contiguous(), chosen = counts[1].contiguous();
        const int64_t recent = counts[2][0].item<int64_t>();
        o.index_put_({step[g + 4]}, windowed
            ? top_k_attention_quantized(qg, w[16], w[17], w[18], w[19], w[20], w[21], w[22], w[23], step[g + 2],
                                        step[g + 1], keys, chosen, recent, scale)
            : top_k_attention(qg, w[16], step[g + 1], keys, chosen, recent, scale));
        continue;
      }
      auto og = windowed ? paged_attention_quantized(qg, w[16], w[17], w[18], w[19], w[20], w[21], w[22], w[23],
                                                     step[g + 2], step[g + 1], step[g + 3], scale)
              : step[g + 2].numel() ? paged_attention_slots(qg, w[16], step[g + 2], step[g + 1], step[g + 3], scale)
                                    : paged_attention(qg, w[16], step[g + 1], step[g + 3], scale);
      o.index_put_({step[g + 4]}, step[g + 5].numel() ? og.index({step[g + 5]}) : og.select(1, 0));
    }
  }
  x = add_into(layer_linear(o.view({T, H * D}), w[4], w[5], w[6]), x);
  auto gate_up = layer_linear(rms_norm(x, w[7], eps), w[8], w[9], w[10]);
  const int64_t inter = gate_up.size(1) / 2;
  auto act = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
  return add_into(layer_linear(act, w[11], w[12], w[13]), x);
#else
  TORCH_CHECK(false, "decoder_layer: needs the row kernel (AVX-512 or AVX2)");
  return x;
#endif
}

torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<torch::Tensor> step,
                            std::vector<double> p) {
  return layer_forward(x, w, step, p);
}

#include <mutex>
#include <unordered_map>

// A model's layers kept here (LayerStack in model/cpu_layer.py), so that a forward runs them all in one call: per
// layer the very decoder_layer above, without Python's layer loop and the conversion of each layer's ~20 tensors
// from Python objects (~0.4 ms of a ~9 ms batch-1 step of SmolLM2-135M on the 2-core VM).
struct Stack {
  std::vector<std::vector<torch::Tensor>> w;
  std::vector<std::vector<double>> p;
};
static std::mutex stacks_lock;
static std::unordered_map<int64_t, std::shared_ptr<Stack>> stacks;
static int64_t stacks_made = 0;

int64_t layer_stack_new(std::vector<std::vector<torch::Tensor>> w, std::vector<std::vector<double>> p) {
  TORCH_CHECK(w.size() == p.size(), "layer_stack_new: one parameter list per layer");
  auto stack = std::make_shared<Stack>(Stack{std::move(w), std::move(p)});
  std::lock_guard<std::mutex> hold(stacks_lock);
  stacks[++stacks_made] = std::move(stack);
  return stacks_made;
}

void layer_stack_free(int64_t id) {
  std::lock_guard<std::mutex> hold(stacks_lock);
  stacks.erase(id);
}

// The stack's `layers` (indices, in the order given) over x; a layer from `sparse_from` on reads `sparse` as its
// step where given (AttentionMetadata.cpu_step.for_layer).
torch::Tensor layer_stack_run(int64_t id, torch::Tensor x, std::vector<int64_t> layers,
                              std::vector<torch::Tensor> step, std::vector<torch::Tensor> sparse,
                              int64_t sparse_from) {
  std::shared_ptr<Stack> stack;
  {
    std::lock_guard<std::mutex> hold(stacks_lock);
    auto found = stacks.find(id);
    TORCH_CHECK(found != stacks.end(), "layer_stack_run: no such stack");
    stack = found->second;
  }
  for (const int64_t i : layers) {
    TORCH_CHECK(0 <= i && i < static_cast<int64_t>(stack->w.size()), "layer_stack_run: no such layer");
    x = layer_forward(x, stack->w[i], !sparse.empty() && i >= sparse_from ? sparse : step, stack->p[i]);
  }
  return x;
}
"""


def linear_parts(m: Any) -> list[torch.Tensor] | None:
    """(weight, scale, bias) of a product the row kernel runs, as the C++ layer takes them; None otherwise."""
    from leapdecode.model.int8_linear import Int8Linear
    from leapdecode.model.packed_linear import PackedLinear
    return m.row_parts() if isinstance(m, (PackedLinear, Int8Linear)) else None


def _products(layer: Any) -> tuple[Any, Any, Any, Any]:
    """A decoder layer's four products (q/k/v, output, gate/up, down), read without Module.__getattr__."""
    attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]


class FusedLayer:
    """One decoder layer's weights laid out for ``decoder_layer``; ``None`` from :meth:`of` where the layer does
    not qualify (see the module docstring). ``rows_max``: the most rows its products take (int8: ``ROWS_MAX``)."""

    def __init__(self, parts: list[torch.Tensor], params: list[float], rows_max: int | None, key: tuple) -> None:
        self.parts, self.params, self.rows_max, self.key = parts, params, rows_max, key

    @staticmethod
    def of(layer: Any) -> FusedLayer | None:
        key = tuple(map(id, _products(layer)))
        cached = layer.__dict__.get("_fused_layer")
        if cached is None or cached.key != key:      # (a draft's int8 copy of a layer copies this attribute)
            cached = layer.__dict__["_fused_layer"] = FusedLayer._build(layer, key)
        return cached if cached.parts else None

    @staticmethod
    def _build(layer: Any, key: tuple) -> FusedLayer:
        from leapdecode.model import layers as model_layers
        from leapdecode.model.int8_linear import Int8Linear
        attn, mlp = layer.self_attn, layer.mlp
        mods = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        fused = FusedLayer([], [], None, key)
        linears = [linear_parts(m) for m in mods]
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if (all(p is not None for p in linears) and attn.q_norm is None and model_layers.FUSED_OPS
                and all(w.dtype == torch.float32 and w.is_contiguous() for w in norms)
                and layer.input_layernorm.eps == layer.post_attention_layernorm.eps):
            fused.parts = [norms[0], *linears[0], *linears[1], norms[1], *linears[2], *linears[3],
                           attn.rope.cos, attn.rope.sin]
            fused.params = [float(layer.input_layernorm.eps), float(attn.num_heads), float(attn.num_kv_heads),
                            float(attn.head_dim), float(attn.scale)]
            if any(isinstance(m, Int8Linear) for m in mods):
                fused.rows_max = Int8Linear.ROWS_MAX
        return fused

    def __call__(self, x: torch.Tensor, cache: list[torch.Tensor], step: list[torch.Tensor]) -> torch.Tensor:
        return native.kernels().decoder_layer(x, self.parts + cache, step, self.params)


def _cache_tensors(attn: Any) -> tuple[bool, list[torch.Tensor]] | None:
    """The attention layer's KV cache as ``decoder_layer`` takes it, (windowed, tensors): a float32 cache, or a
    windowed quantized cache's codes, grids and float32 window; None where the one-call layer cannot read it.
    Memoized on the layer per cache object (a cache never changes its tensors): checking and listing them on every
    call cost ~10 us a layer."""
    kv_cache = attn.kv_cache
    cached = attn.__dict__.get("_cache_tensors")
    if cached is None or cached[0] is not kv_cache:
        entry = None
        if isinstance(kv_cache, WindowedLayer):
            if cpu_exact.reads(kv_cache):
                entry = (True, list(cpu_exact.quantized_tensors(kv_cache)))
        elif type(kv_cache) is torch.Tensor and kv_cache.dtype == torch.float32 and kv_cache.is_contiguous():
            entry = (False, [kv_cache])
        cached = attn.__dict__["_cache_tensors"] = (kv_cache, entry)
    return cached[1]


def _takes(x: torch.Tensor, cpu: Any, rows_max: int | None, windowed: bool) -> bool:
    """Does the step (``meta.cpu_step``) let layers whose products take at most ``rows_max`` rows and whose cache
    is (or is not) windowed run over ``x`` in one call?"""
    return (cpu is not None and cpu.windowed == windowed and x.dim() == 2 and x.dtype == torch.float32
            and x.shape[0] == cpu.tensors[1].shape[0] and (rows_max is None or x.shape[0] <= rows_max))


def run(layer: Any, x: torch.Tensor, meta: Any) -> torch.Tensor | None:
    """The layer's output through the one-call path, or None where the step or the layer does not allow it."""
    if meta.cpu_step is None:
        return None
    attn = layer._modules["self_attn"]
    fused = FusedLayer.of(layer)
    cache = _cache_tensors(attn)
    if fused is None or cache is None or not _takes(x, meta.cpu_step, fused.rows_max, cache[0]):
        return None
    step = meta.cpu_step.for_layer(attn.layer_idx)
    return fused(x if x.is_contiguous() else x.contiguous(), cache[1], step)


class LayerStack:
    """A model's decoder layers held by the compiled module (``layer_stack_new``), so that a forward over any of them
    is one call (``layer_stack_run``: all of a target's forward, Kangaroo's early layers, layer_skip's kept ones).
    Each layer runs the very ``decoder_layer`` the layer-by-layer path calls, on the same inputs in the same order,
    so the results are its bits; what goes is Python's layer loop and the conversion of every layer's ~20 tensors
    at each call (~0.4 ms of a ~9 ms batch-1 step of SmolLM2-135M on the 2-core VM). Built from the layers as they
    are (each qualifying for the one-call layer: :class:`FusedLayer`, :func:`_cache_tensors`); :func:`stack_of`
    builds a new one when a layer's products or cache were swapped."""

    def __init__(self, handle: int, rows_max: int | None, windowed: bool) -> None:
        self.handle, self.rows_max, self.windowed = handle, rows_max, windowed
        self._free = native.kernels().layer_stack_free

    def __del__(self) -> None:
        try:
            self._free(self.handle)
        except Exception:           # interpreter shutdown: the module may be gone already
            pass

    def __call__(self, x: torch.Tensor, meta: Any, layers: Sequence[int]) -> torch.Tensor | None:
        """The model's ``layers`` (indices, in that order) over ``x``, or None where the step does not allow the
        one-call path (as :func:`run` would say for each layer)."""
        cpu = meta.cpu_step
        if not _takes(x, cpu, self.rows_max, self.windowed):
            return None
        return native.kernels().layer_stack_run(self.handle, x if x.is_contiguous() else x.contiguous(), layers,
                                                cpu.tensors, cpu.sparse or [], cpu.sparse_from)


def _stack_parts(layers: list[Any]) -> list[Any]:
    """What a model's stack is built from: each layer's four products and its cache (compared by identity)."""
    out = []
    for layer in layers:
        out += (*_products(layer), layer._modules["self_attn"].kv_cache)
    return out


def stack_of(model: Any, layers: list[Any]) -> LayerStack | None:
    """The :class:`LayerStack` of ``model``'s ``layers`` (kept on the model, rebuilt when a product or cache has
    been swapped), or None where one of them does not qualify for the one-call layer or the kernels are missing."""
    kernels = native.kernels()
    if kernels is None or not hasattr(kernels, "layer_stack_new"):
        return None
    built_from = _stack_parts(layers)
    held = model.__dict__.get("_layer_stack")      # (the model's id: a shallow copy of it builds its own)
    if (held is not None and held[0] == id(model) and len(held[1]) == len(built_from)
            and all(a is b for a, b in zip(held[1], built_from))):
        return held[2]
    stack = None
    parts, params, windowed, rows_max = [], [], set(), None
    for layer in layers:
        fused = FusedLayer.of(layer)
        cache = _cache_tensors(layer._modules["self_attn"])
        if fused is None or cache is None:
            parts = None
            break
        parts.append(fused.parts + cache[1])
        params.append(fused.params)
        windowed.add(cache[0])
        if fused.rows_max is not None:
            rows_max = fused.rows_max if rows_max is None else min(rows_max, fused.rows_max)
    if parts and len(windowed) == 1:
        stack = LayerStack(kernels.layer_stack_new(parts, params), rows_max, windowed.pop())
    model.__dict__["_layer_stack"] = (id(model), built_from, stack)    # (held: no id is reused while kept)
    return stack


def drop_stack(model: Any) -> None:
    """Let go of ``model``'s stack (the compiled module's hold on its weights and caches)."""
    model.__dict__.pop("_layer_stack", None)


__all__ = ["FusedLayer", "LayerStack", "drop_stack", "linear_parts", "run", "stack_of"]
