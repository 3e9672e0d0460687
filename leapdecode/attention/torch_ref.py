"""Portable attention over the paged cache in plain PyTorch: runs on CPU and CUDA, and is the test oracle.

Sequences with short query runs are attended in padded batches (plain decodes apart from verification and short
prefills, each kind in groups of similar context length, so a row is never padded to a verification's length nor
to a much longer context), long prefill chunks one by one,
all through one function with an explicit mask built from token positions, so chunked prefill, token trees and
sliding windows share a single rule: a query at position p sees keys at positions <= p
that are earlier context or (for trees) its ancestors. The masks and gather indices are built once per step in
``plan``; each layer only gathers its own keys and values and runs SDPA. With sparse attention on (lossy, opt-in),
long decode rows are planned apart as a ``SparseStep`` (attention/sparse.py), which reads only selected keys.

A quantized cache is read by dequantizing the gathered blocks before SDPA (a windowed cache, int8/int4 or fp8 with
recent tokens: open and recent blocks come from the full-precision window); a layer first quantizes the blocks its
step seals, measuring their tokens' saliency with the probe queries when the format keeps salient tokens
(``kv_quant.normalized_attention``). That is the portable reference; on the CPU the exact kernel reads quantized
caches in place instead (``exact``, below), and on a GPU the Triton backend does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leapdecode.attention import cpu_exact, kv_quant
from leapdecode.attention.backend import AttentionBackend, AttentionMetadata, CpuStep, SealPlan
from leapdecode.attention.kv_cache import Fp8Layer, WindowedLayer
from leapdecode.attention.sparse import SparseAttention, SparseStep

EXACT_MODES = ("off", "kernel", "always")     # see TorchAttention.__init__
_EMPTY = torch.empty(0, dtype=torch.int64)

# Sequences with at most this many query tokens (decodes, verification, short prefills) share one padded batch;
# longer prefill chunks run alone so padding never multiplies their cost.
BATCH_MAX_QUERY = 32
# The longest query run of a group the exact kernel reads (None: any). benchmarks/prefill_exact.py sets it to
# BATCH_MAX_QUERY to measure long prompt chunks through SDPA, as they ran before the kernel took them.
KERNEL_MAX_QUERY: int | None = None
# A padded batch is split where a sequence's context is more than PAD_RATIO times the shortest in its group (and
# the group has MIN_GROUP rows): decode attention is a memory-bound read of every gathered key, padding included
# (64 decodes of 100-1,000 tokens padded to 1,000 read ~4x the keys they attend).
PAD_RATIO = 2.0
MIN_GROUP = 8


def _by_length(rows: list[int], lens: list[int]) -> list[list[int]]:
    """``rows`` in groups of similar context length (ascending), each padded only to its own longest."""
    order = sorted(rows, key=lambda i: lens[i])
    groups: list[list[int]] = [[]]
    for i in order:
        g = groups[-1]
        if len(g) >= MIN_GROUP and lens[i] > PAD_RATIO * lens[g[0]]:
            groups.append([i])
        else:
            g.append(i)
    if len(groups) > 1 and len(groups[-1]) < MIN_GROUP:     # a short tail joins the group before it
        tail = groups.pop()
        groups[-1] += tail
    return [g for g in groups if g]


@dataclass
class _Group:
    """Sequences attended in one padded SDPA call: [B, max_q] queries over [B, max_k] gathered keys."""
    blocks: torch.Tensor       # [B, nblocks] block ids to gather
    max_k: int
    q_index: torch.Tensor      # [B, max_q] flat query row of each padded query (clamped)
    valid_q: torch.Tensor | None   # [B, max_q]; None when every sequence has exactly one query (decode)
    out_index: torch.Tensor    # flat rows of the valid queries, in valid_q order
    mask: torch.Tensor         # [B, 1, max_q, max_k]
    window: torch.Tensor | None = None   # [B, nblocks] window block of an open block (-1: sealed), windowed caches
    # a tree group's rows as the exact kernel reads them on a float cache: each node's keys by slot (see
    # ``_tree_rows``); None for other groups
    by_slot: "_Group | None" = None
    slots: torch.Tensor | None = None   # (in ``by_slot``) [B * max_q, max_k] cache slot of each row's keys
    ctx: torch.Tensor | None = None     # (in ``by_slot``) [B] keys every row of the sequence shares (its context)


class TorchAttention(AttentionBackend):
    name = "torch"
    kv_cache_dtypes = kv_quant.KV_CACHE_DTYPES

    def __init__(self, sparse: SparseAttention | None = None, exact: str = "off") -> None:
        """``exact``: whether a row's result may depend on its query length, padding or batch partners. PyTorch's
        float32 SDPA blocks its work by query length and padded key length, so a row's last bits differ between
        plain decoding (one query), verification (several) and other batch partners: a near-tie can flip, and
        bfloat16 activations (``quantization="int4"``) turn such bits into different tokens (greedy speculation
        matched plain decoding on 10 of 12 documents). "kernel": every row on a CPU float or quantized cache -
        decodes, verifications and prompt chunks of any length - goes through the C++ kernel of
        attention/cpu_exact.py, which computes each row alone (exact by construction, so a prompt's keys, values and
        first token do not depend on how it was chunked or how much of it came from the prefix cache; decode rows
        no slower than gather + SDPA, prompt chunks 0.95-1.17x float32 SDPA's speed end to end, and a
        quantized cache is dequantized row by row as the kernel reads it, 2-6x faster than dequantizing the
        gathered blocks), float32 SDPA where the kernel is unavailable (no compiler, a GPU);
        "always": the same, with that fallback in float64, where those differences sit ~29 bits below float32's
        last bit and rounding almost never shows them; "off": SDPA."""
        if exact not in EXACT_MODES:
            raise ValueError(f"exact must be one of {EXACT_MODES}, got {exact!r}")
        self.sparse = sparse
        self.exact = exact

    def plan(self, meta: AttentionMetadata) -> None:
        short = [i for i, n in enumerate(meta.query_lens) if 0 < n <= BATCH_MAX_QUERY]
        sparse = self.sparse.step(meta, short) if self.sparse is not None else None
        if sparse is not None:
            taken = set(sparse.rows)
            short = [i for i in short if i not in taken]
        # plain decodes apart from multi-token rows (verification, short prefills): padded together, every decode
        # row would pay for the longest row's queries (at batch 16, SDPA cost doubled on speculating steps); each
        # kind in groups of similar context length (64 verifications over 50-1,000-token contexts padded to the
        # longest: 1,334 ms a step on the CPU, grouped 940 ms, plain decoding 842 ms)
        single = [i for i in short if meta.query_lens[i] == 1 and meta.tree(i) is None]
        multi = [i for i in short if meta.query_lens[i] > 1 or meta.tree(i) is not None]
        # token trees apart where the exact kernel may read their nodes' keys by slot (``_tree_rows``)
        trees = [i for i in multi if meta.tree(i) is not None] if self.exact != "off" and not meta.positions.is_cuda \
            else []
        multi = [i for i in multi if i not in trees] if trees else multi
        lens = meta.seq_lens_host
        groups = [_group(meta, g) for g in _by_length(single, lens) + _by_length(multi, lens) if g]
        for g in _by_length(trees, lens):
            group = _group(meta, g)
            group.by_slot = _tree_rows(meta, g, group)
            groups.append(group)
        groups += [_group(meta, [i]) for i, n in enumerate(meta.query_lens) if n > BATCH_MAX_QUERY]
        meta.plan = groups + ([sparse] if sparse is not None else [])
        meta.cpu_step = self._cpu_step(meta)

    def _cpu_step(self, meta: AttentionMetadata) -> CpuStep | None:
        """What model/cpu_layer.py needs to run a layer in one call, where every group of this step is attended by
        the exact kernel (decodes, verifications, short prefill chunks) or, for sparse decode rows of the per_layer
        rule, by the top-k kernel (attention/cpu_sparse.py), and nothing is sealed: the positions, the slots
        written (a windowed cache's: window slots), then per group its query rows, block table (a tree group read
        by slot: its sequences' context lengths), key slots (a tree group's, ``_tree_rows``; a windowed cache's
        group: its window map; else empty), mask, output rows and valid queries (query and output rows empty when
        the group's queries are the step's tokens in order); a top-k group has the rows' keys, chosen positions and
        window (int64 [3, B]) in the mask's place. Else None (the layer-by-layer path)."""
        n = meta.num_actual_tokens
        sparse = self.sparse
        if (self.exact == "off" or (sparse is not None and not sparse.per_layer) or meta.kv_seal is not None
                or meta.positions.is_cuda or len(meta.positions) != n or cpu_exact.kernel() is None):
            return None         # (tidal keeps positions between layers; pages' bounds record each layer's keys)
        # a windowed cache: the step writes window slots and every group reads through its window map, in place
        # (token trees too: the quantized kernel reads a tree's nodes in place, as ``attend`` does)
        windowed = meta.kv_window is not None
        step = [meta.positions, (meta.kv_write if windowed else meta.slot_mapping)[:n]]
        top_k: list[torch.Tensor] | None = None
        for g in meta.plan:
            if isinstance(g, SparseStep):       # full attention below the first selection layer, top-k above
                rows, blocks = g.out_index, g.blocks.to(torch.int64).contiguous()
                wmap = g.kv_window.to(torch.int64).contiguous() if windowed else _EMPTY
                counts = torch.stack([g.seq_lens, g.chosen, torch.full_like(g.chosen, sparse.window)])
                top_k = step + [rows, blocks, wmap, counts, rows, _EMPTY]
                step = step + [rows[:, None], blocks, wmap, g.key_valid[:, None].contiguous(), rows, _EMPTY]
                continue
            if g.q_index.shape[1] > BATCH_MAX_QUERY:
                return None
            blocks, mask = g.blocks.to(torch.int64).contiguous(), g.mask[:, 0].contiguous()
            valid = _EMPTY if g.valid_q is None else g.valid_q
            if windowed:
                group = [g.q_index, blocks, g.window.to(torch.int64).contiguous(), mask, g.out_index, valid]
            elif g.by_slot is not None:
                t = g.by_slot
                group = [t.q_index, t.ctx, t.slots, t.mask[:, 0].contiguous(), t.out_index, t.valid_q]
            elif (len(meta.plan) == 1 and g.q_index.numel() == n and torch.equal(g.q_index.flatten(), torch.arange(n))
                    and (g.valid_q is None or bool(g.valid_q.all()))):
                group = [_EMPTY, blocks, _EMPTY, mask, _EMPTY, _EMPTY]
            else:
                group = [g.q_index, blocks, _EMPTY, mask, g.out_index, valid]
            step += group
            if top_k is not None:
                top_k += group
        if top_k is None:
            return CpuStep(step, windowed=windowed)
        return CpuStep(step, top_k, sparse.first_selection, windowed)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 layer: int | None = None) -> None:
        n = meta.num_actual_tokens
        if self.sparse is not None and self.sparse.pages and layer is not None:
            self.sparse.record_keys(layer, k[:n], meta.slot_mapping[:n], kv_cache, meta.block_size)
        if isinstance(kv_cache, Fp8Layer):
            kv_cache.write(k[:n], v[:n], meta.slot_mapping[:n])
            return
        if isinstance(kv_cache, WindowedLayer):
            kv_cache.write(k[:n], v[:n], meta.kv_write[:n], meta.kv_seal)
            return
        _, nb, bs, hkv, d = kv_cache.shape
        flat = kv_cache.view(2, nb * bs, hkv, d)
        slots = meta.slot_mapping[:n]
        flat[0].index_copy_(0, slots, k[:n].to(kv_cache.dtype))
        flat[1].index_copy_(0, slots, v[:n].to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               layer: int | None = None) -> torch.Tensor:
        if meta.plan is None:
            self.plan(meta)
        if isinstance(kv_cache, WindowedLayer) and meta.kv_seal is not None:
            seal_blocks(q, kv_cache, meta.kv_seal, scale)
        out = torch.empty_like(q)
        for g in meta.plan:
            if isinstance(g, SparseStep):
                out[g.out_index] = g.attend(q, kv_cache, scale, layer).to(out.dtype)
                continue
            o = None
            if self.exact != "off" and (KERNEL_MAX_QUERY is None or g.q_index.shape[1] <= KERNEL_MAX_QUERY):
                if isinstance(kv_cache, torch.Tensor) and kv_cache.device.type == "cpu":
                    t = g.by_slot
                    if t is not None:
                        o = cpu_exact.attend_slots(q[t.q_index], kv_cache, t.slots, t.ctx, t.mask[:, 0], scale)
                        if o is not None:
                            out[t.out_index] = o[t.valid_q].to(out.dtype)
                            continue
                    o = cpu_exact.attend(q[g.q_index], kv_cache, g.blocks, g.mask[:, 0], scale)  # [B, max_q, H, D]
                elif cpu_exact.reads(kv_cache):                # a quantized cache: dequantized as the kernel reads
                    o = cpu_exact.attend_quantized(q[g.q_index], kv_cache, g.blocks, g.window, g.mask[:, 0], scale)
            if o is None:
                k, v = _read(kv_cache, g)                                               # [B, max_k, Hkv, D]
                qg, k, v = q[g.q_index].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, max_q, D]
                if self.exact == "always":
                    qg, k, v = qg.double(), k.double(), v.double()
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale, enable_gqa=True)
                o = o.transpose(1, 2)
            out[g.out_index] = (o[:, 0] if g.valid_q is None else o[g.valid_q]).to(out.dtype)
        return out


def _read(kv_cache: torch.Tensor | Fp8Layer | WindowedLayer, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values [B, max_k, Hkv, D] in the model's dtype (dequantized when the cache is)."""
    if isinstance(kv_cache, torch.Tensor):
        k, v = kv_cache[0][g.blocks].flatten(1, 2), kv_cache[1][g.blocks].flatten(1, 2)
    elif isinstance(kv_cache, Fp8Layer):
        k, v = kv_cache.read(g.blocks)
    else:
        k, v = kv_cache.read(g.blocks, g.window)
    return k[:, :g.max_k], v[:, :g.max_k]


def _tree_rows(meta: AttentionMetadata, seqs: list[int], group: _Group) -> _Group | None:
    """``group`` (the tree sequences ``seqs`` as read in place) with its rows' keys by cache slot, each node over
    its context then its ancestors at consecutive key indices: the keys plain decoding would hold after that node's
    path, at the same indices, so the kernel's sums run in the same lanes and chunks and a node's bits are plain
    decoding's (read in place, a node's ancestors sit at their node numbers, not their depths, and its sums would
    differ in the last bits). A tree stays one sequence of max_q rows (the kernel loads the shared context's chunks
    once); its query rows are the group's. None if a node's position is not its context plus its depth."""
    bs, max_q = meta.block_size, group.q_index.shape[1]
    positions = meta.positions[group.q_index].cpu()                 # [B, max_q]
    parts = []      # per sequence: (its rows' key slots [max_q, c + q], keys per row [max_q], positions [max_q])
    ctx = []        # per sequence: its context (keys every row reads)
    for b, i in enumerate(seqs):
        q, k = meta.query_lens[i], meta.seq_lens_host[i]
        c, tree = k - q, meta.tree(i).cpu()
        ctx.append(c)
        idx = torch.arange(k)
        slot = meta.block_tables[i].cpu()[idx // bs] * bs + idx % bs
        seen = tree.sum(1)                                          # a node's ancestors and itself
        first = torch.argsort((~tree).to(torch.int8), dim=1, stable=True)   # seen nodes first, ascending
        if not torch.equal(positions[b, :q], c + seen - 1):
            return None
        rows = torch.cat([torch.arange(q), torch.full((max_q - q,), q - 1)])   # padding rows repeat the last node
        parts.append((torch.cat([slot[:c].expand(q, c), slot[c:][first]], 1)[rows], (c + seen)[rows],
                      positions[b, :q][rows]))
    max_k = max(int(n.max()) for _, n, _ in parts)
    slots = torch.cat([torch.nn.functional.pad(x, (0, max_k - x.shape[1])) for x, _, _ in parts])
    lens = torch.stack([n for _, n, _ in parts])                     # [B, max_q]
    key = torch.arange(max_k)
    mask = key[None, None, :] < lens[:, :, None]
    if meta.sliding_window is not None:
        mask &= key[None, None, :] > (torch.stack([p for _, _, p in parts])[:, :, None] - meta.sliding_window)
    return _Group(_EMPTY, max_k, group.q_index, group.valid_q, group.out_index, mask[:, None], slots=slots,
                  ctx=torch.tensor(ctx, dtype=torch.int64))


def seal_blocks(q: torch.Tensor, layer: WindowedLayer, seal: SealPlan, scale: float) -> None:
    """Quantize the blocks this step seals; with salient tokens, rank them by the probes' normalized attention."""
    salient = None
    if layer.layout.num_salient:
        score = kv_quant.normalized_attention(q[seal.probes.clamp(min=0)], layer.staged_keys(), seal.probes >= 0,
                                              scale)
        salient = kv_quant.top_salient(score, layer.layout.num_salient)
    layer.seal(seal.blocks, salient)


def _group(meta: AttentionMetadata, seqs: list[int]) -> _Group:
    dev = meta.positions.device
    qlens = [meta.query_lens[i] for i in seqs]
    klens = [meta.seq_lens_host[i] for i in seqs]
    max_q, max_k = max(qlens), max(klens)
    # (a group's rows come in its own order, by context length: arange only when that is the step's order)
    idx = torch.arange(len(seqs), device=dev) if seqs == list(range(meta.num_seqs)) else torch.tensor(seqs, device=dev)
    qpos_in_seq = torch.arange(max_q, device=dev)
    klen_t = meta.seq_lens[idx]
    nblocks = -(-max_k // meta.block_size)
    key_idx = torch.arange(max_k, device=dev)
    window = meta.kv_window[idx, :nblocks] if meta.kv_window is not None else None
    if max_q == 1 and all(meta.tree(i) is None for i in seqs):
        # decodes: the query sits at position klen - 1 and sees every key before it (within the window)
        q_index = meta.query_start_loc[idx][:, None]
        mask = key_idx[None, :] < klen_t[:, None]
        if meta.sliding_window is not None:
            mask &= key_idx[None, :] > (klen_t[:, None] - 1 - meta.sliding_window)
        return _Group(meta.block_tables[idx, :nblocks], max_k, q_index, None, q_index[:, 0], mask[:, None, None],
                      window)
    qlen_t = (meta.query_start_loc[1:] - meta.query_start_loc[:-1])[idx]
    valid_q = qpos_in_seq[None, :] < qlen_t[:, None]                                      # [B, max_q]
    q_index = (meta.query_start_loc[idx][:, None] + qpos_in_seq[None, :]).clamp(max=meta.num_actual_tokens - 1)
    q_pos = meta.positions[q_index]                                                        # [B, max_q]
    # a key's position is its index, except for this step's tokens, which carry their own (token trees)
    num_ctx = klen_t - qlen_t
    new = key_idx[None, :] - num_ctx[:, None]                                              # [B, max_k]
    is_new = (new >= 0) & (key_idx[None, :] < klen_t[:, None])
    new_pos = q_pos.gather(1, new.clamp(0, max_q - 1))
    key_pos = torch.where(is_new, new_pos, key_idx[None, :])
    mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_idx[None, None, :] < klen_t[:, None, None])
    for b, i in enumerate(seqs):
        tree = meta.tree(i)
        if tree is not None:
            c = klens[b] - qlens[b]
            mask[b, :qlens[b], c:klens[b]] = tree
    if meta.sliding_window is not None:
        mask &= key_pos[:, None, :] > (q_pos[:, :, None] - meta.sliding_window)
    mask &= valid_q[:, :, None]
    mask[:, :, 0] |= ~valid_q                      # padding rows see one key, so softmax stays finite
    return _Group(meta.block_tables[idx, :nblocks], max_k, q_index, valid_q, q_index[valid_q], mask[:, None], window)
