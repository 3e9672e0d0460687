"""The KV of a prompt's first full blocks as a value that can leave its engine (prefill/decode disaggregation).

A prefill instance computes a prompt, ``Engine.export_kv`` copies the prefix-cached blocks that hold it to the CPU,
the payload travels (it pickles: Ray's object store, a socket), and the decode instance's ``Engine.import_kv``
installs the blocks as cached free blocks, so the request adopts them in ``match_prefix`` exactly like a
prefix-cache hit. Nothing else in the engine knows about transfers.

The payload says which cache format it was read from (``layout``); a block is only meaningful to an engine whose
cache has the same format, so ``check`` refuses any other, naming what differs. The weights are not part of the
signature: both engines must load the same checkpoint (same model, same dtype), which the caller guarantees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.attention.kv_cache import KVLayout


def transfer_layout(layout: KVLayout) -> tuple[tuple[str, object], ...]:
    """The signature of a cache format, as (name, value) pairs so a mismatch can be named: the model's KV shape,
    the block size, the model's dtype (what the KV was computed in, and the window's dtype) and the storage format
    with its parameters (int4's salient tokens per block)."""
    return (("num_layers", layout.num_layers), ("num_kv_heads", layout.num_kv_heads), ("head_dim", layout.head_dim),
            ("block_size", layout.block_size), ("dtype", str(layout.dtype).replace("torch.", "")),
            ("kv_cache_dtype", layout.kv_cache_dtype), ("num_salient", layout.num_salient))


@dataclass(frozen=True)
class KVTransfer:
    """The KV of a prompt's first full blocks, movable between engines of the same model and KV format."""
    layout: tuple                           # transfer_layout() of the cache the blocks were read from
    token_ids: tuple[int, ...]              # the num_blocks * block_size tokens the blocks hold
    blocks: tuple                           # per block, in chain order: a tuple of contiguous CPU tensors, one
                                            # per plane of the format (``KVCache.read_blocks``: codes, scales...)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of KV carried (scales included; token ids and pickling overhead not counted)."""
        return sum(t.numel() * t.element_size() for block in self.blocks for t in block)

    def check(self, layout: tuple) -> None:
        """ValueError unless this payload fits a cache whose signature is ``layout`` and is whole (one block per
        ``block_size`` tokens)."""
        ours, theirs = dict(layout), dict(self.layout)
        diff = [f"{name}={theirs.get(name)!r} (this engine: {ours.get(name)!r})"
                for name in dict.fromkeys([*ours, *theirs]) if ours.get(name) != theirs.get(name)]
        if diff:
            raise ValueError("the KV transfer was read from a different KV cache layout: " + ", ".join(diff))
        if self.num_tokens != self.num_blocks * ours["block_size"]:
            raise ValueError(f"the KV transfer is malformed: {self.num_tokens} token ids for {self.num_blocks} "
                             f"blocks of {ours['block_size']} tokens")
        if not all(isinstance(b, tuple) and all(isinstance(t, torch.Tensor) for t in b) for b in self.blocks):
            raise ValueError("the KV transfer is malformed: each block must be a tuple of tensors")
