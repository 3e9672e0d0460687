"""Portable attention over the paged cache in plain PyTorch: runs on CPU and CUDA, and is the test oracle.

Sequences with one query token (plain decode) are attended in one padded batch; sequences with several (prefill
chunks, speculative verification) one by one with an explicit mask built from token positions, so chunked prefill,
token trees and sliding windows share a single rule: a query at position p sees keys at positions <= p that are
either earlier context or (for trees) its ancestors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from leapdecode.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttention(AttentionBackend):
    name = "torch"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping
        _, nb, bs, hkv, d = kv_cache.shape
        flat = kv_cache.view(2, nb * bs, hkv, d)
        flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1 and i not in meta.tree_masks]
        if decode:
            self._decode_batch(q, kv_cache, meta, scale, decode, out)
        qsl = meta.query_start_loc.tolist() if len(decode) < meta.num_seqs else None
        for i, n in enumerate(meta.query_lens):
            if n == 1 and i not in meta.tree_masks:
                continue
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._one_sequence(q[start:end], kv_cache, meta, i, scale)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., nblocks] block ids -> keys and values [..., nblocks * block_size, Hkv, D] (trimmed for 1-D)."""
        k = kv_cache[0][block_table].flatten(-4, -3)
        v = kv_cache[1][block_table].flatten(-4, -3)
        return k[..., :num_keys, :, :], v[..., :num_keys, :, :]

    def _decode_batch(self, q, kv_cache, meta, scale, rows, out) -> None:
        idx = torch.tensor(rows, device=q.device)
        max_len = max(meta.seq_lens_host[i] for i in rows)
        nblocks = -(-max_len // meta.block_size)
        k, v = self._gather(kv_cache, meta.block_tables[idx, :nblocks], max_len)    # [B, L, Hkv, D]
        seq_lens = meta.seq_lens[idx].long()
        key_pos = torch.arange(max_len, device=q.device)
        mask = key_pos[None, :] < seq_lens[:, None]                                   # [B, L]
        if meta.sliding_window is not None:
            mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - meta.sliding_window)
        qrows = meta.query_start_loc[idx].long()
        o = F.scaled_dot_product_attention(
            q[qrows].unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),             # [B, H, 1, D], [B, Hkv, L, D]
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[qrows] = o.squeeze(2).to(out.dtype)

    def _one_sequence(self, q, kv_cache, meta, i, scale) -> torch.Tensor:
        n, num_keys = q.shape[0], meta.seq_lens_host[i]
        nblocks = -(-num_keys // meta.block_size)
        k, v = self._gather(kv_cache, meta.block_tables[i, :nblocks], num_keys)       # [L, Hkv, D]
        start = meta.query_start_loc[i]
        q_pos = meta.positions[start:start + n]
        num_ctx = num_keys - n                                                      # keys before this step
        key_pos = torch.cat([torch.arange(num_ctx, device=q.device), q_pos])
        mask = key_pos[None, :] <= q_pos[:, None]
        tree = meta.tree_masks.get(i)
        if tree is not None:
            mask[:, num_ctx:] = tree
        if meta.sliding_window is not None:
            mask &= key_pos[None, :] > (q_pos[:, None] - meta.sliding_window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),               # [H, n, D], [Hkv, L, D]
            attn_mask=mask[None], scale=scale, enable_gqa=True)
        return o.transpose(0, 1).to(q.dtype)
