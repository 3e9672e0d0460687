"""Int8 linear layers for the CPU, for drafters: weights int8 per output channel (inputs float through the row
kernel, quantized per call through fbgemm).

A drafter's matmuls at batch 1 read every weight for a handful of rows, so on a CPU they are bound by memory
bandwidth: the EAGLE head's draft-vocabulary LM head (8,192 x 576 float32, 19 MB) took 2.8 ms per call on one core
here, the same matmul from int8 weights through fbgemm 0.6 ms. Drafts only have to be good guesses: verification
against the target decides every token and, under sampling, uses the draft distribution q that the int8 head really
produced, so quantizing a drafter changes its acceptance, never the output. The target itself is never quantized
by this module.

Two kernels. Where the row kernel runs (model/packed_linear.py: AVX-512, the layer's outputs a multiple of 16), the
int8 weights are packed in its blocks and widened to float in registers as they stream past the rows: weight-only
int8, the inputs stay float32, so the result is the float matmul of the dequantized weights (no error from
quantizing activations). Measured on the 2-core Intel Xeon VM (AVX-512) over every linear of SmolLM2-135M (121
matrices, weights streamed): 1 row 4.7-5.0 ms against fbgemm's 6.5-6.8 (float32 through the row kernel 19-20),
5 rows 7.1-7.9 against 9.0-9.9, but 17 rows 20.3 against 13.9: widening costs a multiply-add per weight and row,
while fbgemm's int8 dot products do four. Since 7-18 rows take one tile (each weight widened once per call, not
once per 6-row tile), the row kernel also wins at 7-12 rows (7 rows 1.38x fbgemm's speed, 12 rows 1.03x; 13 rows
0.88x), so past 12 rows (``ROWS_MAX``) fbgemm serves.
For those rows, and where the row kernel does not run, PyTorch's fbgemm dynamic-quantization linear
(``quantized::linear_dynamic``; ``reduce_range`` as the x86 backend needs it to avoid saturating its 16-bit
accumulation), available on x86 CPU builds of PyTorch; :func:`available` says whether either runs here, and callers
keep their float layers where neither does.
"""
from __future__ import annotations

import copy
import functools
import time
import warnings

import torch
from torch import nn

from leapdecode.model import packed_linear


@functools.lru_cache(maxsize=None)
def _fbgemm_works() -> bool:
    """Whether this PyTorch build can pack and run fbgemm's int8 linear (the quantized-tensor API it relies on is
    deprecated upstream: when a release drops it, drafters quietly keep their float weights unless the row kernel
    serves)."""
    try:
        return bool(torch.backends.quantized.engine in ("x86", "fbgemm")
                    and Int8Linear(torch.ones(2, 2))(torch.ones(1, 2)).shape == (1, 2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def available(device: torch.device | str = "cpu") -> bool:
    """Whether int8 drafting matmuls can run on ``device`` (a CPU with the row kernel or PyTorch's fbgemm)."""
    return torch.device(device).type == "cpu" and (packed_linear.rows_kernel() is not None or _fbgemm_works())


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 per output channel (symmetric scales). Up to ``ROWS_MAX`` rows a call
    go through the row kernel where it runs here (``kernel == "rows"``), more through fbgemm, whose weight is then
    packed from the same int8 values at the first such call (see the module docstring)."""

    # up to 12 rows the row kernel takes all of them in one tile (model/packed_linear.py, narrow_tiles); the default
    # model's shapes, 2 threads, against fbgemm: 7 rows 1.38x faster, 9 rows 1.27x, 12 rows 1.03x, 13 rows 0.88x
    ROWS_MAX = 12

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        self.out_features, self.in_features = w.shape
        self._scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        self._bias = None if bias is None else bias.detach().float().cpu().contiguous()
        q = torch.round(w / self._scales[:, None]).clamp(-127, 127).to(torch.int8)
        rows = packed_linear.float_rows()       # (the AVX-512 form: on AVX2 its int8 tiles are measured nowhere)
        self._rows = rows if self.out_features % packed_linear.BLOCK == 0 else None
        self.kernel = "rows" if self._rows is not None else "fbgemm"
        self._q = None      # the int8 values, kept only until fbgemm's packing needs them
        self._fbgemm = None
        if self._rows is not None:
            self._packed = packed_linear.pack_rows(q)
            self._scale = self._scales.float()
            self._row_bias = packed_linear.ABSENT if self._bias is None else self._bias
        else:
            self._q = q
        # fbgemm's op overload, called directly: a draft position calls it 121 times on SmolLM2-135M, and the
        # packet's dispatch plus reshaping a row that needs none cost ~6 of its ~25 us at one row
        self._op = torch.ops.quantized.linear_dynamic.default

    def _fbgemm_weight(self) -> torch.Tensor:
        if self._fbgemm is None:
            q = self._q if self._q is not None else packed_linear.unpack_rows(self._packed)
            with warnings.catch_warnings():     # quantized tensors are deprecated as a user type; the op is what we use
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    q.contiguous(), self._scales, torch.zeros(self.out_features, dtype=torch.long), 0)
                self._fbgemm = torch.ops.quantized.linear_prepack(qw, self._bias)
            self._q = None
        return self._fbgemm

    def row_parts(self) -> list[torch.Tensor] | None:
        """(weight, scale, bias) as the row kernel takes them, or None where fbgemm serves every call."""
        return None if self._rows is None else [self._packed, self._scale, self._row_bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if self._rows is not None and (rows.shape[0] <= self.ROWS_MAX or not _fbgemm_works()):
            y = self._rows.rows_linear_int8(rows, self._packed, self._scale, self._row_bias)
        else:
            y = self._op(rows, self._fbgemm_weight(), True)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def replace_linears(module: nn.Module, names: list[str], make, prefix: str = "") -> int:
    """Replace, in place, the linear layers at the dotted attribute paths ``names`` (under ``prefix``) of ``module``
    by ``make(layer)``; returns how many."""
    for name in names:
        name = f"{prefix}.{name}" if prefix else name
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, make(getattr(parent, leaf)))
    return len(names)


def quantize_linears(module: nn.Module, names: list[str], prefix: str = "") -> int:
    """Replace, in place, the linear layers at ``names`` (anything with a 2-D ``weight`` and an optional ``bias``
    that computes x W^T + b) by :class:`Int8Linear`; returns how many."""
    return replace_linears(module, names, lambda m: Int8Linear(m.weight, getattr(m, "bias", None)), prefix)


def linear_names(module: nn.Module) -> list[str]:
    """Dotted paths of ``module``'s matmul layers: nn.Linear, the model's own (column/row parallel) linears and
    their oneDNN-packed form (model/packed_linear.py)."""
    from leapdecode.model.packed_linear import PackedLinear
    from leapdecode.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
    kinds = (nn.Linear, ColumnParallelLinear, RowParallelLinear, PackedLinear)
    return [name for name, m in module.named_modules() if name and isinstance(m, kinds)]


def int8_copy(module: nn.Module, names: list[str]) -> nn.Module:
    """A copy of ``module`` in which the linear layers at ``names`` are :class:`Int8Linear` and everything else
    (parameters, buffers, norms, the attention backend and its KV binding) is shared with the original, which is
    left untouched: a drafter can run the target's own layers from int8 weights beside the float target."""
    made: set[int] = set()                         # ids of the copies (each original is copied once)
    copies: dict[int, nn.Module] = {}               # id of an original -> its copy

    def clone(m: nn.Module) -> nn.Module:
        c = copy.copy(m)
        c._modules = dict(m._modules)               # the copy's own child table; children stay shared until copied
        made.add(id(c))
        copies[id(m)] = c
        return c

    root = clone(module)
    for name in names:
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            child = parent._modules[part]
            if id(child) not in made:
                child = parent._modules[part] = clone(child)
            parent = child
        layer = parent._modules[leaf]
        parent._modules[leaf] = Int8Linear(layer.weight, getattr(layer, "bias", None))
        copies[id(layer)] = parent._modules[leaf]
    # plain lists of submodules kept beside the child table (the model's ``_layer_list``, which its forward walks)
    # follow the copy, or the copy's forward would run the original's layers
    for c in [m for m in root.modules() if id(m) in made]:
        for name, value in list(vars(c).items()):
            if isinstance(value, list) and value and all(isinstance(v, nn.Module) for v in value):
                setattr(c, name, [copies.get(id(v), v) for v in value])
    return root


def weight_read_ratio(layer: torch.Tensor | nn.Module, reps: int = 5) -> float:
    """Measured time of one row through a weight in int8 over float: what an int8 draft token costs relative to the
    float model on this machine (the drafters' cost models use it). ``layer``: the float weight (timed through
    F.linear), or the float layer as the target runs it (e.g. oneDNN-packed, model/packed_linear.py)."""
    weight = layer if isinstance(layer, torch.Tensor) else layer.weight
    x = torch.randn(1, weight.shape[1])
    q = Int8Linear(weight)
    w = weight.detach().float()
    ref = layer if isinstance(layer, nn.Module) else (lambda x: torch.nn.functional.linear(x, w))

    def best(f) -> float:
        f()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)
    return best(lambda: q(x)) / max(best(lambda: ref(x)), 1e-9)


def choose(int8: bool | None, dtype: torch.dtype, device: torch.device | str, layer: torch.Tensor | nn.Module,
           who: str, threshold: float = 0.8) -> float | None:
    """A drafter's ``int8`` option resolved: None = keep float weights, else int8's measured cost over float's for
    one row through ``layer`` (a weight, or the float layer as the model runs it; one measurement, which a cost
    model may reuse). ``int8=None`` (the default) = int8 where it is available and measurably faster (small
    models' matrices are not: fbgemm's per-call quantization of the input then costs more than the read it saves),
    and never where the target's layer already reads a GGUF file's 4- or 8-bit codes (model/packed_linear.py: no
    more bytes than int8; the measurement, one layer's weights in the cache, cannot see what int8's extra bytes
    cost a draft that streams every layer); True = int8, a ValueError naming ``who`` off a float32 CPU or without
    the kernel; False = float (the target's own weights)."""
    cpu32 = dtype == torch.float32 and torch.device(device).type == "cpu"
    if int8 and not (cpu32 and available(device)):
        raise ValueError(f"{who}: int8 drafting runs on a float32 CPU target with PyTorch's fbgemm/x86 kernels only")
    if int8 is False or not (cpu32 and available(device)):
        return None
    if int8 is None and getattr(layer, "kernel", "").startswith("rows_q"):
        return None        # the target reads a GGUF file's codes (model/packed_linear.py): no more bytes than int8
    ratio = weight_read_ratio(layer)
    return None if int8 is None and ratio >= threshold else ratio


__all__ = ["Int8Linear", "available", "choose", "int8_copy", "linear_names", "quantize_linears", "replace_linears", "weight_read_ratio"]
