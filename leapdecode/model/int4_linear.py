"""Weight-only 4-bit linears for the CPU (``LLM(..., quantization="int4")``): LOSSY, opt-in.

Why: a CPU decode step streams every weight for a handful of rows. SmolLM2-135M in float32 is 540 MB a step; as
4-bit codes with a bfloat16 scale and zero per group of 32 weights its layers take ~60 MB, and PyTorch's CPU kernel
for that format (``_weight_int4pack_mm_for_cpu``, the one torchao and gpt-fast use) runs them with bfloat16
activations, float32 accumulation. Measured on the 2-core test VM (benchmarks/README.md, "cpu_int4.py"): 2.0x
float32's decoding speed at batch 1 on short chat contexts, 1.05x at batch 16 (its kernel's per-row arithmetic
catches up with float32's there): a latency mode against float32 weights. (Since then the default path reads a
4-bit GGUF's codes itself, model/packed_linear.py, and runs the default model ~2x faster than this mode; see
``quantization="int8_activations"`` there for the faster lossy mode.)

**Codes.** ``w = (code - 8) * scale + zero`` for each group of 32 input columns. A group whose values lie on one
grid of at most 16 levels (what every 4-bit GGUF block holds once the loader has dequantized it: Q4_0, Q4_1, the
32-weight sub-blocks of Q4_K) gets that grid's step as its scale and exact codes, so a 4-bit file keeps its own
weights up to the bfloat16 rounding of scale and zero; any other group (float checkpoints, Q8_0, Q6_K) is
requantized from its minimum and maximum, which is where most of the loss comes from. :func:`quantize_model`
reports the share of groups kept exactly.

**LM head.** The tied embedding of a 4-bit GGUF is often Q8_0; 4 bits blurred it (+5% perplexity on the default
model), so the head runs in bfloat16 through oneDNN (:class:`BF16Linear`; weights rounded to bfloat16).

**Speculation stays lossless.** Verification computes several rows of a sequence in one call where plain decoding
computes one; both kernels must give a row the same bits whatever shares its call. That holds for the int4 kernel
and for oneDNN's bfloat16 linear on many shapes but not all (bfloat16 with 1536 inputs splits its reduction by
the row count), so every layer shape is probed once at load (:func:`row_independent`) and a shape that fails
keeps the float layer. Attention is the other half: float32 SDPA gives a row different last bits as a plain
decode, a verification row or beside a padded partner, and rounding activations to bfloat16 turns those bits
into different tokens (on the real model 2 of 12 documents and 21 of 48 batch-1 outputs left plain decoding's
text with n-gram speculation). So under this mode the engine attends exactly (``TorchAttention(exact="always")``,
set by ``ModelRunner``: attention/cpu_exact.py's kernel computes each decode and verification row alone, in a
fixed order), which makes every output identical again at 1.00x SDPA's speed at batch 1 on 600-1,000-token
contexts and 1.29x at batch 16. ``batch_invariant=False`` opts out (speculation then warns that its greedy output
can differ from plain decoding's).

Only on a CPU, without tensor parallelism, and only the target's linears (not a draft model's, not embeddings).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

GROUP = 32             # input columns per scale/zero pair: the block size of GGUF's 4-bit formats
_N_MULTIPLE = 16       # the CPU packing kernel needs output features in multiples of 16


def grid_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``weight`` [N, K] (K a multiple of :data:`GROUP`) -> (codes int32 [N, K] in 0..15, scale [N, K/GROUP],
    zero [N, K/GROUP], number of groups kept exactly), with ``w ~= (code - 8) * scale + zero`` per group.

    A group is exact when its values sit on a grid ``low + j * step`` with integer j in 0..15 (tolerance 1e-3
    of a step); ``step`` is span / 15 or else the smallest gap between its distinct values. Otherwise its codes
    are the nearest of 16 levels between its minimum and maximum."""
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    span = high - low

    def on_grid(values: torch.Tensor, base: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        level = (values - base.unsqueeze(-1)) / step.unsqueeze(-1)
        return (torch.isfinite(step) & (step > 0) & ((level - level.round()).abs() <= 1e-3).all(-1)
                & (level.amax(-1) <= 15 + 1e-3))

    # Most 4-bit blocks use all 16 levels (Q4_1 always: its minimum and maximum are levels 0 and 15), so the
    # step is span / 15; only the groups that fail that look for their smallest gap (a sort).
    step = span / 15
    exact = on_grid(g, low, step)
    rest = (~exact & (span > 0)).nonzero(as_tuple=True)
    if rest[0].numel():
        sub, sub_low, sub_span = g[rest], low[rest], span[rest]
        gaps = sub.sort(-1).values.diff(dim=-1)
        gaps = torch.where(gaps > 1e-6 * sub_span.unsqueeze(-1), gaps, torch.full_like(gaps, float("inf")))
        sub_step = gaps.amin(-1)
        ok = on_grid(sub, sub_low, sub_step)
        step = step.index_put(rest, torch.where(ok, sub_step, step[rest]))
        exact = exact.index_put(rest, ok)
    exact |= span == 0               # a constant group: scale 0, zero = its value
    scale = step                     # the grid's step, or span / 15: the min/max requantization
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((g - low.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, 15)
    codes = torch.where((scale > 0).unsqueeze(-1), codes, torch.zeros_like(codes))
    zero = low + 8 * scale
    return (codes.reshape(n, k).to(torch.int32), scale.float(), zero.float(), int(exact.sum()))


class Int4Linear(nn.Module):
    """y = x W^T + b with W as 4-bit codes and a bfloat16 scale and zero per group of 32 inputs (module doc)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.scale_zero = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()   # [K/32, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple["Int4Linear", int]:
        """The layer for a float weight, and how many of its groups kept their values exactly (:func:`grid_codes`)."""
        codes, scale, zero, exact = grid_codes(weight)
        return cls(codes, scale, zero, bias), exact

    @property
    def weight(self) -> torch.Tensor:
        """A dense float32 copy of the weight as the kernel sees it (rounded to bfloat16), for set-up code that
        reads weights (int8 drafts, EAGLE binding); not used by ``forward``."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scale_zero).float().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scale_zero).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, "
                f"bias={self.bias is not None}")


class BF16Linear(nn.Module):
    """y = x W^T with W in bfloat16, packed once for oneDNN; bfloat16 activations, output in the input's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16).contiguous(), None)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "").to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def row_independent(layer: Callable[[torch.Tensor], torch.Tensor], in_features: int, max_rows: int = 80) -> bool:
    """Whether ``layer`` gives each row the same bits whatever other rows share the call: compared on rows of
    random data in calls of 1 to ``max_rows`` rows (those a verification or a batched decode step makes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, in_features, generator=g)
    full = layer(x)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64):
        if m > max_rows:
            break
        for start in {0, max_rows - m}:
            if not torch.equal(layer(x[start:start + m]), full[start:start + m]):
                return False
    return True


@functools.lru_cache(maxsize=None)
def _shape_ok(kind: str, n: int, k: int) -> bool:
    """Whether this machine's kernel for ``kind`` ("int4" or "bf16") is row-independent at shape [n, k] (random
    weights of that shape; probed once per shape and process)."""
    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g)
    layer = Int4Linear.from_float(w)[0] if kind == "int4" else BF16Linear(w)
    return row_independent(layer, k)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this PyTorch has the CPU int4 kernel and oneDNN's bfloat16 linear, and they compute x W^T."""
    try:
        g = torch.Generator().manual_seed(1)
        w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
        ref = x @ w.t()
        int4, _ = Int4Linear.from_float(w)
        ok4 = torch.allclose(int4(x), x @ int4.weight.t(), rtol=2e-2, atol=2e-2)
        ok16 = torch.allclose(BF16Linear(w)(x), ref, rtol=2e-2, atol=5e-2)
        return bool(ok4 and ok16)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# "int8_activations": LOSSY int8 activations on a GGUF's own 4- and 8-bit codes (model/packed_linear.py: rows_q4a8,
# rows_q8a8, applied by pack_model; nothing to replace here)
QUANTIZATIONS = (None, "int4", "int8_activations")


def quantize_model(model: nn.Module, quantization: str | None) -> dict[str, int]:
    """Replace, in place, a leapdecode Llama model's layer linears by :class:`Int4Linear` and its LM head by
    :class:`BF16Linear` (``quantization="int4"``; None does nothing). A linear whose shape the kernel cannot take
    (inputs not a multiple of 32, outputs not of 16) or on which it is not row-independent stays as it was.
    Returns counts: ``int4`` layers, ``exact_groups`` / ``groups`` (weights kept exactly, see :func:`grid_codes`),
    ``kept_float`` layers, ``bf16_head`` (0 or 1)."""
    from leapdecode.model.int8_linear import linear_names, replace_linears
    counts = {"int4": 0, "exact_groups": 0, "groups": 0, "kept_float": 0, "bf16_head": 0}
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization != "int4":
        return counts
    param = next(model.parameters())
    head = model.output_head
    if param.device.type != "cpu" or not available():
        raise ValueError(f"quantization='int4' runs on a CPU with PyTorch's int4 and oneDNN bfloat16 kernels "
                         f"(got {param.device.type}{'' if param.device.type != 'cpu' else ' without them'})")
    if getattr(head, "tp", None) is not None and head.tp.size > 1:
        raise ValueError("quantization='int4' does not work with tensor_parallel_size > 1 yet")

    def make(layer: nn.Module) -> nn.Module:
        weight = layer.weight
        n, k = weight.shape
        if k % GROUP or n % _N_MULTIPLE or not _shape_ok("int4", n, k):
            counts["kept_float"] += 1
            return layer
        new, exact = Int4Linear.from_float(weight, getattr(layer, "bias", None))
        counts["int4"] += 1
        counts["exact_groups"] += exact
        counts["groups"] += n * k // GROUP
        return new

    replace_linears(model.layers, linear_names(model.layers), make)
    if counts["groups"] and counts["exact_groups"] == counts["groups"]:
        import warnings
        warnings.warn("quantization='int4' on a model whose layers are all 4-bit GGUF blocks: without it the row "
                      "kernel reads those very codes at float32 precision (the default model on an AVX-512 CPU: int4 "
                      "ran at 0.46x of that at batch 1); quantization='int8_activations' is the faster lossy mode "
                      "there",
                      stacklevel=2)
    vocab, hidden = head.weight.shape
    if _shape_ok("bf16", vocab, hidden):
        head.packed_logits = BF16Linear(head.weight)
        counts["bf16_head"] = 1
    return counts


__all__ = ["BF16Linear", "GROUP", "Int4Linear", "QUANTIZATIONS", "available", "grid_codes", "quantize_model",
           "row_independent"]
