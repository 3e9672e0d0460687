"""The GPU attention backend: Triton kernels behind the same seam as the torch reference (``torch_ref``).

Per step, sequences are split by their query length: decode rows (one token) go to the split-KV decode kernel, all
others (prefill chunks, speculative verification rows, token trees) to the prefill kernel. Both write into one
output tensor, so a mixed batch costs at most two launches per layer. The split, the packed tree masks and the
index tensors are planned once per step (``plan``) from the host copies in ``AttentionMetadata`` and reused by
every layer, so no layer waits on a device sync.

A quantized cache (``kv_cache_dtype``: fp8, int8, int4) is read by the same kernels, which decode each K/V tile as
they load it, exactly as ``kv_quant`` decodes (fp8 codes times their per-token scales; int8/int4 units on KIVI's
grids, int4's salient tokens at 8 bits); a windowed cache (int8/int4, fp8 with recent tokens) has its open and
recent blocks read from the full-precision window by the step's ``kv_window`` table. Writing is the reference's:
fp8 without a window quantizes with ``kv_quant.fp8_quantize`` and stores codes and scales with the copy kernel; a
windowed cache writes and seals with the torch backend's own code (``WindowedLayer.write``, ``seal_blocks``), in
device work only, so its steps can be captured (engine/cuda_graphs.py pads each step's seals to its bucket).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.attention import kv_quant
from leapdecode.attention.backend import AttentionBackend, AttentionMetadata
from leapdecode.attention.kv_cache import Fp8Layer, WindowedLayer
from leapdecode.attention.torch_ref import seal_blocks
from leapdecode.attention.triton_kernels import (QuantizedKV, paged_decode_attention, paged_prefill_attention,
                                                 write_kv_triton)


@dataclass
class _Plan:
    decode_ids: torch.Tensor | None       # [n] int32: sequences with one query token
    decode_max_len: int
    prefill_ids: torch.Tensor | None      # [m] int32: the others
    prefill_max_q: int
    tree_mask: torch.Tensor | None        # flat uint8, see attention/backend.py
    tree_offsets: torch.Tensor | None     # [B] int32, -1: no tree
    block_tables: torch.Tensor            # int32 copies of the metadata (the kernels index with int32)
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_window: torch.Tensor | None = None  # windowed caches: the window block of each table entry (-1: pool)


class TritonAttention(AttentionBackend):
    name = "triton"
    kv_cache_dtypes = kv_quant.KV_CACHE_DTYPES

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | Fp8Layer | WindowedLayer,
                 meta: AttentionMetadata, layer: int | None = None) -> None:
        n = meta.num_actual_tokens
        slots = meta.slot_mapping[:n]
        if isinstance(kv_cache, WindowedLayer):
            kv_cache.write(k[:n], v[:n], meta.kv_write[:n], meta.kv_seal)
        elif isinstance(kv_cache, Fp8Layer):
            (kc, ks), (vc, vs) = kv_quant.fp8_quantize(k[:n]), kv_quant.fp8_quantize(v[:n])
            write_kv_triton(kc, vc, kv_cache.codes, slots)
            write_kv_triton(ks[..., None], vs[..., None], kv_cache.scales[..., None], slots)
        else:
            write_kv_triton(k[:n], v[:n], kv_cache, slots)

    def plan(self, meta: AttentionMetadata) -> None:
        trees = meta.tree_offsets_host or [-1] * meta.num_seqs
        dec = [i for i, n in enumerate(meta.query_lens) if n == 1 and trees[i] < 0]
        pre = [i for i, n in enumerate(meta.query_lens) if n > 1 or (n == 1 and trees[i] >= 0)]
        device = meta.positions.device
        # the one host-to-device copy of a step outside the runner's staging buffer (not yet measured on a GPU)
        ids = torch.tensor(dec + pre, dtype=torch.int32).to(device, non_blocking=True)
        has_tree = meta.tree_mask is not None
        meta.plan = _Plan(
            decode_ids=ids[:len(dec)] if dec else None,
            decode_max_len=max((meta.seq_lens_host[i] for i in dec), default=0),
            prefill_ids=ids[len(dec):] if pre else None,
            prefill_max_q=max((meta.query_lens[i] for i in pre), default=0),
            tree_mask=meta.tree_mask.to(torch.uint8) if has_tree else None,
            tree_offsets=meta.tree_offsets.to(torch.int32) if has_tree else None, **_int32_indices(meta))

    def plan_graph(self, meta: AttentionMetadata, query_len: int) -> None:
        """The plan of a captured CUDA graph (engine/cuda_graphs.py): every sequence has at most ``query_len``
        tokens and no tree. Only device work, no host data, so it can be captured and replayed with new inputs:
        one token each goes to the decode kernel (split for ``seq_lens_host``, the longest length the graph
        serves), otherwise every sequence goes to the prefill kernel (a sequence with fewer tokens, or none, just
        ends its tiles early)."""
        ids = torch.arange(meta.num_seqs, dtype=torch.int32, device=meta.positions.device)
        decode = query_len == 1
        meta.plan = _Plan(
            decode_ids=ids if decode else None, decode_max_len=max(meta.seq_lens_host) if decode else 0,
            prefill_ids=None if decode else ids, prefill_max_q=0 if decode else query_len,
            tree_mask=None, tree_offsets=None, **_int32_indices(meta))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               layer: int | None = None) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_actual_tokens == 0:
            return out
        if meta.plan is None:
            self.plan(meta)
        p = meta.plan
        quant, cache = None, kv_cache
        if isinstance(kv_cache, WindowedLayer):
            if meta.kv_seal is not None:           # this step's blocks that seal: quantized before anyone reads
                seal_blocks(q, kv_cache, meta.kv_seal, scale)
            lay = kv_cache.layout
            cache, quant = kv_cache.codes, QuantizedKV(
                lay.kv_cache_dtype, kv_cache.scales, kv_cache.key_grid, kv_cache.value_grid,
                kv_cache.salient if lay.num_salient else None, kv_cache.residual if lay.num_salient else None,
                kv_cache.window, p.kv_window)
        elif isinstance(kv_cache, Fp8Layer):
            cache, quant = kv_cache.codes, QuantizedKV("fp8", kv_cache.scales)
        common = (cache, p.block_tables, p.seq_lens, p.query_start_loc, meta.positions, scale)
        if p.decode_ids is not None:
            paged_decode_attention(q, *common, seq_ids=p.decode_ids, max_seq_len=p.decode_max_len,
                                   sliding_window=meta.sliding_window, out=out, quant=quant)
        if p.prefill_ids is not None:
            paged_prefill_attention(q, *common, max_query_len=p.prefill_max_q, seq_ids=p.prefill_ids,
                                    sliding_window=meta.sliding_window, tree_mask=p.tree_mask,
                                    tree_offsets=p.tree_offsets, out=out, quant=quant)
        return out


def _int32_indices(meta: AttentionMetadata) -> dict:
    """int32 copies of the metadata's index tensors (the kernels index with int32); device work only."""
    return dict(block_tables=meta.block_tables.to(torch.int32), seq_lens=meta.seq_lens.to(torch.int32),
                query_start_loc=meta.query_start_loc.to(torch.int32),
                kv_window=meta.kv_window.to(torch.int32) if meta.kv_window is not None else None)
