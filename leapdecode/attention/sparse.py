"""Sparse attention for long decode rows: LOSSY, opt-in (``EngineConfig.sparse_attention``). Two ways to choose what a
layer reads (``SparseAttentionConfig.selection``); both always read the ``window`` most recent positions (the current
token included) besides the ``budget`` chosen ones, and leave rows whose context is no longer than budget + window in
the backend's ordinary full-attention batch, so their outputs are exact. Only decode rows (one query, no token tree)
are sparse; prefill and verification rows attend fully.

**per_layer** (the default; top-k attention, Gupta et al., "Memory-efficient Transformers via Top-k Attention",
2021): every layer from ``dense_layers`` up scores every earlier position with its own query, per KV head (the
attention probability the position receives, summed over the head's query group), and attends exactly over its top
``budget`` positions and the window. It reads every key but only the chosen values and attends over ~budget keys;
the layers below ``dense_layers`` attend fully (as Quest and TidalDecode leave the first two layers dense).

**tidal** (TidalDecode, Yang, Zhang, Chen, Li and Jia, "TidalDecode: Fast and Accurate LLM Decoding with Position
Persistent Sparse Attention", 2024, arXiv:2410.05076): the paper observes that the positions a decoding query
attends to most overlap strongly from one layer to the next, so a few *token-selection layers* attend fully and keep
the positions with the highest attention scores, and every layer above a selection layer (until the next one) reads
only those: k keys and values instead of n. One set of positions is chosen per sequence per step, shared by every
head, by the attention probability each key receives summed over all the selection layer's query heads (heads do not
correspond from one layer to the next, so a per-head choice has no meaning for the layers that reuse it; on
SmolLM2-135M the shared choice gave a mean KL to full attention of 0.11 against 0.18 per KV head).

Why per_layer is the default, measured on SmolLM2-135M-Instruct (needle in an 8k haystack of licence texts, greedy;
benchmarks/kv_compression.py): with each layer choosing its own top 10% (or 5%) per KV head, every answer was
identical to full attention's (10 of 10 prompts); tidal at layers (2, 12) found 2 of the 10 needles full attention
found 8 of, and in smaller trials 0 of 2 at a 30% budget, 1 of 2 at 50%. Ranked by layer 2's attention, the
needle's digits sit near the bottom of 8,000 positions, while the layers that copy them (14-23) rank them in their
top 10%: positions do not persist across this model's layers (the paper's models are 7-8B). Of twelve other tidal
layer sets tried on 2 prompts, one found both needles ((12, 18, 24)), three found one, eight none. tidal reads ~6x
less at 8k; per_layer reads every key and ~10% of the values. pages (below) at 10%: decode attention 3.0x cheaper
than full at 8k (per_layer 2.15x, same quiet run; both against float32 SDPA), 4 of 10 needles. On the CPU per_layer
is one C++ call (attention/cpu_sparse.py): a sparse layer 1.5x faster than the exact kernel's full attention at 8k,
the selection's positions and outputs those of the torch formulation below (to float rounding).

**pages** (Quest, Tang, Zhu, Zhao, Zhang, Kasikci and Han, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference", ICML 2024, arXiv:2406.10774): a block of the paged cache is a page; as keys are written each page
keeps, per KV head and channel, the minimum and maximum of its keys. A query's score for any key of a page is at
most the sum over channels of max(q * min, q * max), so each layer from ``dense_layers`` up bounds every page with
its own queries (the most any query head of a KV group can give it), and attends exactly over the top pages that
hold ``budget`` tokens plus the pages holding the window. It reads the bounds (two vectors per page) and the chosen
pages, not the whole context. Bounds are kept in this module (one writer: ``record_keys``, called by the backend's
``write_kv``; imported blocks through ``record_blocks``); KV copied within the cache (a fork's partial block) is not
in its page's bounds, which can then miss that page (lossy, never wrong-shaped).

Positions are logical token indices, turned into cache slots through the sequence's block table, so paged KV and
shared prefix-cache blocks need nothing special. The state of one step (which rows, what was selected) lives in the
``SparseStep`` the backend puts into ``meta.plan``: per step, never global. Not done here: TidalDecode's KV-cache
correction (re-filling the KV of sparsely decoded tokens with full attention); their KV, computed with sparse
attention, is cached and prefix-shared like any other.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from leapdecode.attention import cpu_exact, cpu_sparse
from leapdecode.attention.backend import AttentionMetadata
from leapdecode.attention.kv_cache import Fp8Layer, WindowedLayer
from leapdecode.config import SparseAttentionConfig

KVLayer = torch.Tensor | Fp8Layer | WindowedLayer       # one layer of the cache, in any kv_cache_dtype


class SparseAttention:
    """One model's resolved settings; plans each step's sparse decode rows (``SparseStep``)."""

    def __init__(self, cfg: SparseAttentionConfig, num_layers: int) -> None:
        self.budget, self.window = cfg.budget, cfg.window
        self.per_layer = cfg.selection == "per_layer"
        self.pages = cfg.selection == "pages"
        self.selection_layers = frozenset(cfg.layers_for(num_layers))
        self.first_selection = min(self.selection_layers)
        # pages: per layer, each block's per-channel key minimum and maximum, [blocks, Hkv, D] float32 each
        self.page_bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record_keys(self, layer: int, k: torch.Tensor, slots: torch.Tensor, kv_cache: "KVLayer",
                    block_size: int) -> None:
        """pages: fold a step's keys [T, Hkv, D] (written at cache ``slots``, -1: padding) into their pages' bounds;
        the token at a page's first offset starts the page afresh (a block handed out again). Only the layers that
        select keep bounds (the dense ones below never read them)."""
        if layer not in self.selection_layers:
            return
        bounds = self.page_bounds.get(layer)
        if bounds is None:
            shape = (_num_blocks(kv_cache), k.shape[1], k.shape[2])
            bounds = self.page_bounds[layer] = (torch.zeros(shape, device=k.device),
                                                torch.zeros(shape, device=k.device))
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k = slots[keep], k[keep]
        blocks = slots // block_size
        fresh = blocks[slots % block_size == 0]
        lo, hi = bounds
        lo[fresh], hi[fresh] = float("inf"), float("-inf")
        kf = k.float()
        index = blocks[:, None, None].expand_as(kf)
        lo.scatter_reduce_(0, index, kf, "amin")
        hi.scatter_reduce_(0, index, kf, "amax")

    def record_blocks(self, layer: int, kv_cache: "KVLayer", blocks: torch.Tensor, block_size: int) -> None:
        """pages: bound whole (full) blocks whose KV arrived without ``write_kv`` (a KV import), from the cache."""
        if isinstance(kv_cache, torch.Tensor):
            keys = kv_cache[0][blocks]
        else:
            keys = (kv_cache.read(blocks[None]) if isinstance(kv_cache, Fp8Layer) else
                    kv_cache.read(blocks[None], None))[0]
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten()
        self.record_keys(layer, keys.reshape(len(slots), *keys.shape[-2:]), slots, kv_cache, block_size)

    def num_selected(self, context_len: int) -> int:
        """Positions chosen by score (besides the window) for a context of ``context_len`` keys."""
        if isinstance(self.budget, float):
            return math.ceil(self.budget * context_len)
        return self.budget

    def is_sparse(self, context_len: int) -> bool:
        return self.num_selected(context_len) + self.window < context_len

    def step(self, meta: AttentionMetadata, rows: list[int]) -> "SparseStep | None":
        """The step's sparse rows among ``rows`` (decodes whose context exceeds budget + window), or None."""
        take = [i for i in rows if meta.query_lens[i] == 1 and meta.tree(i) is None
                and self.is_sparse(meta.seq_lens_host[i])]
        return SparseStep(self, meta, take) if take else None


class SparseStep:
    """One step's sparse decode rows: dense attention below the first selection layer; then, per_layer: each layer
    attends over its own top positions; tidal: dense attention plus a new selection at each selection layer,
    attention over the selected positions everywhere else."""

    def __init__(self, policy: SparseAttention, meta: AttentionMetadata, rows: list[int]) -> None:
        dev = meta.positions.device
        self.policy, self.rows = policy, rows
        lens = [meta.seq_lens_host[i] for i in rows]
        chosen = [policy.num_selected(n) for n in lens]
        self.max_len, self.num_chosen = max(lens), max(chosen)
        idx = torch.tensor(rows, device=dev)
        self.out_index = meta.query_start_loc[idx]                                    # the rows' query tokens
        bs = meta.block_size
        nblocks = -(-self.max_len // bs)
        self.blocks = meta.block_tables[idx, :nblocks]                                # [B, nblocks]
        self.kv_window = meta.kv_window[idx, :nblocks] if meta.kv_window is not None else None   # windowed
        self.seq_lens = seq_lens = torch.tensor(lens, device=dev)
        key = torch.arange(self.max_len, device=dev)
        self.key_valid = key[None, :] < seq_lens[:, None]                             # [B, max_len]
        w = policy.window
        self.candidate = key[None, :] < (seq_lens[:, None] - w)                       # scored: before the window
        self.window_pos = seq_lens[:, None] - w + torch.arange(w, device=dev)        # [B, w]
        # the padded top-k slots of rows with fewer chosen positions are masked; the window is always valid
        chosen_valid = torch.arange(self.num_chosen, device=dev)[None, :] < torch.tensor(chosen, device=dev)[:, None]
        self.selected_valid = torch.cat([chosen_valid, torch.ones(len(rows), w, dtype=torch.bool, device=dev)], 1)
        self.chosen = torch.tensor(chosen, device=dev)                                # [B] positions chosen per row
        self.positions: torch.Tensor | None = None     # [B, num_chosen + window] logical positions selected (tidal)
        self._slots: torch.Tensor | None = None        # the same as cache slots, flat
        # the cache slot of every position of each row [B, nblocks * bs]: both selections gather through it
        self.position_slots = (self.blocks[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)
        if policy.pages:
            self._plan_pages(lens, chosen, bs, nblocks, dev)

    def _plan_pages(self, lens: list[int], chosen: list[int], bs: int, nblocks: int, dev: torch.device) -> None:
        """pages: which pages each row may choose (those before the window's first page), how many (enough for its
        budget), and the window's pages, always read."""
        w = self.policy.window
        first_window = [(n - w) // bs for n in lens]
        self.num_pages = max(-(-c // bs) for c in chosen)
        self.page_limit = torch.tensor([-(-c // bs) for c in chosen], device=dev)                  # [B]
        first = torch.tensor(first_window, device=dev)[:, None]
        self.page_candidate = torch.arange(nblocks, device=dev)[None, :] < first                   # [B, nblocks]
        span = max((n - 1) // bs - f + 1 for n, f in zip(lens, first_window))
        last = (self.seq_lens[:, None] - 1) // bs
        wp = first + torch.arange(span, device=dev)                                               # [B, span]
        self.window_page_valid = wp <= last
        self.window_pages = torch.minimum(wp, last)
        self.bs = bs

    def attend(self, q: torch.Tensor, kv_cache: KVLayer, scale: float, layer: int | None) -> torch.Tensor:
        """q: the step's [T, H, D] queries -> [B, H, D] outputs of this step's sparse rows at ``layer``."""
        if layer is None:
            raise ValueError("sparse attention needs the layer index: call attend(..., layer=i)")
        q = q[self.out_index]
        if layer < self.policy.first_selection:
            return self._dense(q, kv_cache, scale)
        if self.policy.per_layer:
            return self._top_k(q, kv_cache, scale)
        if self.policy.pages:
            return self._pages(q, kv_cache, scale, layer)
        if layer in self.policy.selection_layers or self._slots is None:   # (a forward may skip a selection layer)
            return self._select(q, kv_cache, scale)
        return self._sparse(q, kv_cache, scale)

    def _context(self, kv_cache: KVLayer, values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' whole contexts, [B, max_len, Hkv, D] keys and values (None when not asked for and the cache is
        full precision, where the values a layer needs are gathered by slot instead). A quantized cache is read
        dequantized, keys and values together (windowed caches: open blocks from the full-precision window)."""
        if isinstance(kv_cache, Fp8Layer):
            k, v = kv_cache.read(self.blocks)
        elif isinstance(kv_cache, WindowedLayer):
            k, v = kv_cache.read(self.blocks, self.kv_window)
        else:
            B = len(self.rows)
            _, _, bs, hkv, d = kv_cache.shape
            k, v = (kv_cache[i].index_select(0, self.blocks.flatten()).view(B, -1, hkv, d) if i == 0 or values
                    else None for i in (0, 1))
        return k[:, :self.max_len], (v[:, :self.max_len] if v is not None else None)

    def _native(self, q: torch.Tensor, kv_cache: KVLayer) -> bool:
        """Whether the CPU kernels read this cache in place (a float cache, or a quantized one the exact kernel
        reads), so no layer gathers the context into a copy."""
        if q.device.type != "cpu" or cpu_exact.kernel() is None:
            return False
        return (kv_cache.device.type == "cpu" if isinstance(kv_cache, torch.Tensor) else cpu_exact.reads(kv_cache))

    def _dense(self, q: torch.Tensor, kv_cache: KVLayer, scale: float) -> torch.Tensor:
        if self._native(q, kv_cache):                   # the exact kernel, as full attention's decode rows
            mask = self.key_valid[:, None]
            if isinstance(kv_cache, torch.Tensor):
                return cpu_exact.attend(q[:, None], kv_cache, self.blocks, mask, scale)[:, 0]
            return cpu_exact.attend_quantized(q[:, None], kv_cache, self.blocks, self.kv_window, mask, scale)[:, 0]
        k, v = self._context(kv_cache)
        return _grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), self.key_valid, scale)

    def _select(self, q: torch.Tensor, kv_cache: KVLayer, scale: float) -> torch.Tensor:
        """Full attention with its probabilities, from which the positions of the layers above are chosen."""
        k, v = (t.transpose(1, 2) for t in self._context(kv_cache))                  # [B, Hkv, max_len, D]
        B, hkv, _, d = k.shape
        qg = q.view(B, hkv, -1, d).float()                                           # [B, Hkv, group, D]
        logits = torch.matmul(qg, k.float().transpose(-1, -2)) * scale               # [B, Hkv, group, max_len]
        probs = logits.masked_fill_(~self.key_valid[:, None, None], float("-inf")).softmax(-1)
        out = torch.matmul(probs, v.float()).view(B, -1, d).to(q.dtype)
        score = probs.sum((1, 2)).masked_fill_(~self.candidate, float("-inf"))      # [B, max_len], all heads
        self.positions = torch.cat([score.topk(self.num_chosen, -1).indices, self.window_pos], -1)
        self._slots = self.position_slots.gather(1, self.positions).flatten()
        return out

    def _top_k(self, q: torch.Tensor, kv_cache: KVLayer, scale: float) -> torch.Tensor:
        """per_layer: each KV head scores every position with this layer's queries and attends over its top
        positions and the window (every key is read, only the chosen values); on the CPU in one kernel call
        (attention/cpu_sparse.py), reading the cache in place."""
        if self._native(q, kv_cache):
            return cpu_sparse.attend(q, kv_cache, self.blocks, self.kv_window, self.seq_lens, self.chosen,
                                     self.policy.window, scale)
        B = len(self.rows)
        k, v = self._context(kv_cache, values=False)                                  # [B, n, Hkv, D]
        hkv, d = k.shape[2], k.shape[3]
        qg = q.view(B, hkv, -1, d)                                                     # [B, Hkv, group, D]
        logits = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale             # [B, Hkv, group, n]
        probs = logits.masked_fill_(~self.key_valid[:, None, None], float("-inf")).softmax(-1)
        score = probs.sum(2).masked_fill_(~self.candidate[:, None], float("-inf"))    # [B, Hkv, n]
        pos = torch.cat([score.topk(self.num_chosen, -1).indices,
                         self.window_pos[:, None].expand(-1, hkv, -1)], -1)            # [B, Hkv, K]
        rows = torch.arange(B, device=q.device)[:, None, None]
        heads = torch.arange(hkv, device=q.device)[None, :, None]
        keys = k[rows, pos, heads]                                                     # [B, Hkv, K, D]
        if v is not None:
            values = v[rows, pos, heads]
        else:
            slots = self.position_slots.gather(1, pos.flatten(1)).view(B, hkv, -1)
            values = kv_cache[1].flatten(0, 1)[slots, heads]
        o = F.scaled_dot_product_attention(qg, keys, values,
                                           attn_mask=self.selected_valid[:, None, None], scale=scale)
        return o.view(B, -1, d)

    def _pages(self, q: torch.Tensor, kv_cache: KVLayer, scale: float, layer: int) -> torch.Tensor:
        """pages: each KV head bounds every candidate page with this layer's queries and attends over its top pages
        and the window's pages (every token of a page that the row holds)."""
        B, bs = len(self.rows), self.bs
        lo, hi = self.policy.page_bounds[layer]
        hkv, d = lo.shape[1], lo.shape[2]
        qg = q.view(B, hkv, -1, d)                                                     # [B, Hkv, group, D]
        qf = qg.float()
        mins, maxs = lo[self.blocks].permute(0, 2, 3, 1), hi[self.blocks].permute(0, 2, 3, 1)  # [B, Hkv, D, nb]
        bound = (torch.matmul(qf.clamp(min=0), maxs) + torch.matmul(qf.clamp(max=0), mins)).amax(2)   # [B, Hkv, nb]
        bound = bound.masked_fill_(~self.page_candidate[:, None], float("-inf"))
        m = min(self.num_pages, bound.shape[-1])
        best, top = bound.topk(m, -1)                                                  # [B, Hkv, m]
        rank_ok = torch.arange(m, device=q.device)[None, None, :] < self.page_limit[:, None, None]
        chosen_ok = rank_ok & (best > float("-inf"))
        pages = torch.cat([top, self.window_pages[:, None].expand(-1, hkv, -1)], -1)   # [B, Hkv, P]
        page_ok = torch.cat([chosen_ok, self.window_page_valid[:, None].expand(-1, hkv, -1)], -1)
        P = pages.shape[-1]
        blk = self.blocks.gather(1, pages.flatten(1)).view(B, hkv, P)
        heads = torch.arange(hkv, device=q.device)[None, :, None]
        if isinstance(kv_cache, torch.Tensor):
            keys, values = (kv_cache[i].permute(0, 2, 1, 3)[blk, heads] for i in (0, 1))   # [B, Hkv, P, bs, D]
        else:
            flat = blk.view(B * hkv, P)
            if isinstance(kv_cache, Fp8Layer):
                k, v = kv_cache.read(flat)
            else:
                win = self.kv_window.gather(1, pages.flatten(1)).view(B * hkv, P)
                k, v = kv_cache.read(flat, win)                                    # [B * Hkv, P * bs, Hkv, D]
            keys, values = (t.view(B, hkv, P * bs, hkv, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
                            for t in (k, v))
        keys, values = keys.reshape(B, hkv, P * bs, d), values.reshape(B, hkv, P * bs, d)
        pos = pages[..., None] * bs + torch.arange(bs, device=q.device)               # [B, Hkv, P, bs]
        valid = (page_ok[..., None] & (pos < self.seq_lens[:, None, None, None])).flatten(2)
        o = F.scaled_dot_product_attention(qg, keys.to(q.dtype), values.to(q.dtype), attn_mask=valid[:, :, None],
                                           scale=scale)
        return o.view(B, -1, d)

    def _sparse(self, q: torch.Tensor, kv_cache: KVLayer, scale: float) -> torch.Tensor:
        """Attention over the selected positions only: budget + window keys are read, not the whole context (a
        quantized cache is dequantized whole first: correct, not faster)."""
        B, K = self.positions.shape
        if isinstance(kv_cache, torch.Tensor):
            _, nb, bs, hkv, d = kv_cache.shape
            k, v = (kv_cache[i].view(nb * bs, hkv, d).index_select(0, self._slots).view(B, K, hkv, d)
                    for i in (0, 1))
        else:
            rows = torch.arange(B, device=q.device)[:, None]
            k, v = (t[rows, self.positions] for t in self._context(kv_cache))
        return _grouped_attention(q, k.transpose(1, 2), v.transpose(1, 2), self.selected_valid, scale)


def _num_blocks(kv_cache: KVLayer) -> int:
    """Blocks of one layer's cache, in any format."""
    return (kv_cache if isinstance(kv_cache, torch.Tensor) else kv_cache.codes).shape[1]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """One query per row: q [B, H, D] over k, v [B, Hkv, K, D] with keys ``valid`` [B, K] -> [B, H, D]. The query
    heads of a KV group are laid out as that group's queries, so keys are never repeated per head."""
    B, hkv, _, d = k.shape
    o = F.scaled_dot_product_attention(q.view(B, hkv, -1, d), k, v, attn_mask=valid[:, None, None], scale=scale)
    return o.view(B, -1, d)
