"""Token bitmasks: one int32 row of ceil(V/32) words per verified position; bit j of word i allows token 32*i + j.

Rows are filled on the CPU by the matchers (see `Matcher.fill_bitmask` and `fill_bitmasks`) while the forward
pass runs, then moved to the logits' device and applied to the whole batch at once with `apply_token_bitmask`.
The implementation is plain torch ops, so the same code runs on CPU and CUDA (one small fused-able expression;
no host round trip).
"""

from __future__ import annotations

import torch

__all__ = ["allocate_token_bitmask", "apply_token_bitmask", "bitmask_to_bool", "bitmask_words"]


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per row."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(rows: int, vocab_size: int, *, pin_memory: bool | None = None) -> torch.Tensor:
    """A CPU int32 tensor [rows, ceil(V/32)] with every token allowed (all bits set).

    Pinned when CUDA is available so that the copy to the device can be non-blocking.
    """
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _bit_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack [rows, W] int32 (or [W]) into a bool tensor [rows, vocab_size] (or [vocab_size])."""
    squeeze = bitmask.dim() == 1
    if squeeze:
        bitmask = bitmask.unsqueeze(0)
    bits = (bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
    return allowed[0] if squeeze else allowed


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | list[int] | None = None
) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place, for all rows at once; returns `logits`.

    logits:  [B, V] (or [V]) float tensor on any device.
    bitmask: [R, W] int32 (CPU or same device); moved to `logits.device` here (non-blocking when pinned).
    rows:    which logits rows the R bitmask rows belong to (default: all, R == B). Rows of requests without a
             grammar are simply not listed, so a mixed batch needs no all-ones padding rows.
    Tokens beyond 32*W (a model vocab padded larger than the tokenizer's) are disallowed.
    """
    squeeze = logits.dim() == 1
    if squeeze:
        logits = logits.unsqueeze(0)
        bitmask = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    vocab = logits.shape[-1]
    mask = bitmask.to(logits.device, non_blocking=True)
    covered = min(vocab, 32 * mask.shape[-1])
    allowed = bitmask_to_bool(mask, covered)
    if rows is None:
        if mask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {mask.shape[0]} rows but logits have {logits.shape[0]}; pass rows=")
        target = logits
    else:
        index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
        target = logits.index_select(0, index)
    target[:, :covered].masked_fill_(~allowed, float("-inf"))
    if covered < vocab:
        target[:, covered:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, index, target)
    return logits[0] if squeeze else logits
