"""The attention seam: what every backend receives for one step, and how a backend is chosen.

One step's tokens are a flat ragged batch. Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
and, after this step's keys are written, has ``seq_lens[i]`` keys in the paged cache, reachable through
``block_tables[i]``. ``positions`` are the tokens' positions (also used for causality, so token-tree drafts work:
a tree node sits at position base + depth). ``tree_mask`` is for token-tree verification: where set for sequence i,
it is a [q_len, q_len] bool matrix saying which of this step's tokens a query may see (its ancestors and itself);
all earlier keys are always visible.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

# KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values).


@dataclass
class AttentionMetadata:
    positions: torch.Tensor           # [T] int64
    slot_mapping: torch.Tensor        # [T] int64, flat slot index in the cache (block * block_size + offset)
    block_tables: torch.Tensor        # [B, max_blocks] int32 (unused entries are 0)
    seq_lens: torch.Tensor            # [B] int32, keys per sequence after this step
    query_start_loc: torch.Tensor     # [B + 1] int32
    query_lens: list[int]             # host copies, to plan without device syncs
    seq_lens_host: list[int]
    block_size: int
    sliding_window: int | None = None
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """Writes this step's keys/values into the paged cache, then attends over it."""

    name = "base"

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """k, v: [T, Hkv, D] -> stored at ``meta.slot_mapping`` (negative slots write nowhere)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D] -> [T, H, D]."""


def get_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    """"torch": the portable reference backend; "triton": the Triton GPU kernels (CUDA only).

    "auto" is the torch backend until the Triton kernels have been verified and measured on a real GPU (so far they
    are verified under the Triton interpreter only); set LEAPDECODE_ATTENTION_BACKEND=triton to opt in."""
    import os

    from leapdecode.attention.torch_ref import TorchAttention
    if name == "auto":
        name = os.environ.get("LEAPDECODE_ATTENTION_BACKEND", "torch").strip().lower() or "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        if device is not None and torch.device(device).type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)")
        from leapdecode.attention.triton_backend import TritonAttention
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch or triton)")
