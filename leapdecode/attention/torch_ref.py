"""Portable attention over the paged cache in plain PyTorch: runs on CPU and CUDA, and is the test oracle.

All sequences with short query runs (decodes, verification, short prefills) are attended in one padded batch, long
prefill chunks one by one, all through one function with an explicit mask built from token positions, so chunked
prefill, token trees and sliding windows share a single rule: a query at position p sees keys at positions <= p
that are earlier context or (for trees) its ancestors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from leapdecode.attention.backend import AttentionBackend, AttentionMetadata


# Sequences with at most this many query tokens (decodes, verification, short prefills) share one padded batch;
# longer prefill chunks run alone so padding never multiplies their cost.
BATCH_MAX_QUERY = 32


class TorchAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        _, nb, bs, hkv, d = kv_cache.shape
        flat = kv_cache.view(2, nb * bs, hkv, d)
        flat[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        short = [i for i, n in enumerate(meta.query_lens) if n <= BATCH_MAX_QUERY]
        if short:
            self._attend_padded(q, kv_cache, meta, scale, short, out)
        for i, n in enumerate(meta.query_lens):
            if n > BATCH_MAX_QUERY:
                self._attend_padded(q, kv_cache, meta, scale, [i], out)
        return out

    def _attend_padded(self, q, kv_cache, meta: AttentionMetadata, scale: float, seqs: list[int], out) -> None:
        """Attend for ``seqs`` in one padded SDPA call: [B, max_q] queries over [B, max_k] gathered keys."""
        dev = q.device
        qlens = [meta.query_lens[i] for i in seqs]
        klens = [meta.seq_lens_host[i] for i in seqs]
        max_q, max_k = max(qlens), max(klens)
        idx = torch.tensor(seqs, device=dev)
        qpos_in_seq = torch.arange(max_q, device=dev)
        qlen_t = torch.tensor(qlens, device=dev)
        valid_q = qpos_in_seq[None, :] < qlen_t[:, None]                                  # [B, max_q]
        q_index = (meta.query_start_loc[idx].long()[:, None] + qpos_in_seq[None, :]).clamp(max=q.shape[0] - 1)
        q_pos = meta.positions[q_index]                                                    # [B, max_q]
        nblocks = -(-max_k // meta.block_size)
        k = kv_cache[0][meta.block_tables[idx, :nblocks]].flatten(1, 2)[:, :max_k]       # [B, max_k, Hkv, D]
        v = kv_cache[1][meta.block_tables[idx, :nblocks]].flatten(1, 2)[:, :max_k]
        key_idx = torch.arange(max_k, device=dev)
        klen_t = torch.tensor(klens, device=dev)
        # a key's position is its index, except for this step's tokens, which carry their own (token trees)
        num_ctx = klen_t - qlen_t
        key_pos = key_idx.expand(len(seqs), max_k).clone()
        new = (key_idx[None, :] >= num_ctx[:, None]) & (key_idx[None, :] < klen_t[:, None])
        key_pos[new] = q_pos[valid_q]
        mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_idx[None, None, :] < klen_t[:, None, None])
        for b, i in enumerate(seqs):
            tree = meta.tree_masks.get(i)
            if tree is not None:
                c = klens[b] - qlens[b]
                mask[b, :qlens[b], c:klens[b]] = tree
        if meta.sliding_window is not None:
            mask &= key_pos[:, None, :] > (q_pos[:, :, None] - meta.sliding_window)
        mask &= valid_q[:, :, None]
        mask[:, :, 0] |= ~valid_q                      # padding rows see one key, so softmax stays finite
        o = F.scaled_dot_product_attention(
            q[q_index].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),            # [B, H, max_q, D]
            attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        out[q_index[valid_q]] = o.transpose(1, 2)[valid_q].to(out.dtype)
