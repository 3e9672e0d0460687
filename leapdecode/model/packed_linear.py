"""Float32 linears on the CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

Why: on a CPU a decode step reads every weight for a handful of rows, and ``F.linear`` (MKL's sgemm in PyTorch's
CPU builds) handles few rows badly on some machines. Measured on the 2-core AMD EPYC VM this project tests on
(AVX2, torch 2.13.0+cpu, 2 threads), all linears of SmolLM2-135M (30 layers and the LM head, 540 MB float32)
with weights streamed from memory as in a real step (benchmarks/cpu_linears.py): MKL 44 ms for 1 row, 80 ms for 2,
87 ms for 5, 118 ms for 17; oneDNN with prepacked weights 31, 28, 40 and 66 ms. End to end that is 1.33x plain
decoding at batch 1 and 1.38x at batch 16, and verifying 4 draft tokens costs 1.3x a plain step's matmuls instead
of 2.0x: it decides whether speculation can pay on a CPU at all. (On tiny matrices, e.g. the embedded test models,
one row is slower packed: the packing is on wherever available, not decided by timing, see :func:`pack_model`.) The results differ from MKL's in the last bits (different summation order; about 6e-5 on
outputs of size ~10) and a row's result does not depend on how many rows share the call.

The kernel is ``torch.ops.mkldnn._linear_pointwise`` with a weight from ``torch.ops.mkldnn._reorder_linear_weight``,
the pair PyTorch's own CPU compiler (inductor) emits for frozen linears. Both are internal ops: :func:`available`
tries them once and callers keep ``F.linear`` where they are missing or disagree with it. Only float32 on the
CPU, and only without tensor parallelism (a row-parallel layer's all-reduce stays with ``F.linear``).

Memory: a packed layer keeps only the packed weight; ``weight`` returns a dense copy for code that reads weights
at set-up (int8 drafts, EAGLE binding). The LM head is packed as an extra copy (the embedding table stays dense
for lookups): about a fifth of SmolLM2-135M's weight bytes more.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
import torch.nn.functional as F


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN with W packed once (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """A dense copy of the weight (exact: packing only reorders), for set-up code; not used by ``forward``."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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


__all__ = ["PackedLinear", "available", "pack_model"]
