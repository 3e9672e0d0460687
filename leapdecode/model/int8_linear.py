"""Int8 linear layers for the CPU, for drafters: weights int8 per output channel, activations quantized per call.

A drafter's matmuls at batch 1 read every weight for a handful of rows, so on a CPU they are bound by memory
bandwidth: the EAGLE head's draft-vocabulary LM head (8,192 x 576 float32, 19 MB) took 2.8 ms per call on one core
here, the same matmul from int8 weights through fbgemm 0.6 ms. Drafts only have to be good guesses: verification
against the target decides every token and, under sampling, uses the draft distribution q that the int8 head really
produced, so quantizing a drafter changes its acceptance, never the output. The target itself is never quantized
by this module.

The kernel is PyTorch's fbgemm dynamic-quantization linear (``quantized::linear_dynamic``; ``reduce_range`` as the
x86 backend needs it to avoid saturating its 16-bit accumulation). It is available on x86 CPU builds of PyTorch;
:func:`available` says whether this build has it, and callers keep their float layers where it does not.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn


def available(device: torch.device | str = "cpu") -> bool:
    """Whether int8 drafting matmuls can run on ``device`` (CPU with PyTorch's fbgemm/x86 backend)."""
    if torch.device(device).type != "cpu":
        return False
    try:
        return (torch.backends.quantized.engine in ("x86", "fbgemm")
                and hasattr(torch.ops.quantized, "linear_dynamic"))
    except (AttributeError, RuntimeError):
        return False


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 per output channel (symmetric scales), packed once for fbgemm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        self.out_features, self.in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():     # quantized tensors are deprecated as a user type; the op is what we use
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, torch.zeros(len(scales), dtype=torch.long), 0, torch.qint8)
            b = None if bias is None else bias.detach().float().cpu()
            self._packed = torch.ops.quantized.linear_prepack(qw, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features).float().contiguous(), self._packed,
                                               True)
        return y.reshape(*lead, self.out_features)


def quantize_linears(module: nn.Module, names: list[str]) -> int:
    """Replace the linear layers at the dotted attribute paths ``names`` of ``module`` (anything with a 2-D
    ``weight`` and an optional ``bias`` that computes x W^T + b) by :class:`Int8Linear`; returns how many."""
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        layer = getattr(parent, leaf)
        setattr(parent, leaf, Int8Linear(layer.weight, getattr(layer, "bias", None)))
    return len(names)


__all__ = ["Int8Linear", "available", "quantize_linears"]
