"""The GPU attention backend: Triton kernels behind the same seam as the torch reference (``torch_ref``).

Per step, sequences are split by their query length: decode rows (one token) go to the split-KV decode kernel, all
others (prefill chunks, speculative verification rows, token trees) to the prefill kernel. Both write into one
output tensor, so a mixed batch costs at most two launches per layer. The split, the packed tree masks and the
index tensors are planned once per step from the host copies in ``AttentionMetadata`` and reused by every layer
(the model calls ``attend`` once per layer with the same metadata object), so no layer waits on a device sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.attention.backend import AttentionBackend, AttentionMetadata
from leapdecode.attention.triton_kernels import (pack_tree_masks, paged_decode_attention, paged_prefill_attention,
                                                 write_kv_triton)


@dataclass
class _Plan:
    decode_ids: torch.Tensor | None       # [n] int32: sequences with one query token
    decode_max_len: int
    prefill_ids: torch.Tensor | None      # [m] int32: the others
    prefill_max_q: int
    tree_mask: torch.Tensor | None        # packed by pack_tree_masks
    tree_offsets: torch.Tensor | None


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None   # the step the cached plan belongs to (kept alive: no id reuse)
        self._plan: _Plan | None = None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        write_kv_triton(k, v, kv_cache, meta.slot_mapping)

    def plan(self, meta: AttentionMetadata, device: torch.device) -> _Plan:
        if self._meta is meta and self._plan is not None:
            return self._plan
        dec = [i for i, n in enumerate(meta.query_lens) if n == 1 and i not in meta.tree_masks]
        pre = [i for i, n in enumerate(meta.query_lens) if n > 1 or (n == 1 and i in meta.tree_masks)]
        ids = torch.tensor(dec + pre, dtype=torch.int32).to(device, non_blocking=True)
        tree_mask, tree_offsets = pack_tree_masks(
            {i: m for i, m in meta.tree_masks.items() if meta.query_lens[i] > 0}, meta.num_seqs, device)
        self._plan = _Plan(
            decode_ids=ids[:len(dec)] if dec else None,
            decode_max_len=max((meta.seq_lens_host[i] for i in dec), default=0),
            prefill_ids=ids[len(dec):] if pre else None,
            prefill_max_q=max((meta.query_lens[i] for i in pre), default=0),
            tree_mask=tree_mask, tree_offsets=tree_offsets)
        self._meta = meta
        return self._plan

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        p = self.plan(meta, q.device)
        common = (kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.positions, scale)
        if p.decode_ids is not None:
            paged_decode_attention(q, *common, seq_ids=p.decode_ids, max_seq_len=p.decode_max_len,
                                   sliding_window=meta.sliding_window, out=out)
        if p.prefill_ids is not None:
            paged_prefill_attention(q, *common, max_query_len=p.prefill_max_q, seq_ids=p.prefill_ids,
                                    sliding_window=meta.sliding_window, tree_mask=p.tree_mask,
                                    tree_offsets=p.tree_offsets, out=out)
        return out
