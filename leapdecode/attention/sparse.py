"""Position-persistent sparse attention for decode rows: LOSSY, opt-in (``EngineConfig.sparse_attention``).

TidalDecode (Yang, Zhang, Chen, Li and Jia, "TidalDecode: Fast and Accurate LLM Decoding with Position Persistent
Sparse Attention", 2024, arXiv:2410.05076) observes that the positions a decoding query attends to most overlap
strongly from one layer to the next. So, within one decode step, a few *token-selection layers* attend fully and
keep the positions with the highest attention scores, and every layer above a selection layer (until the next one)
attends only to those positions: it reads k keys instead of n. The paper attends fully in layers 0-1, selects at
layer 2 and re-selects at one middle layer (layer 13 of Llama-3-8B's 32); layers below the first selection layer
attend fully here too (nothing is selected yet).

Selection rule. The paper ranks keys by the current query's attention scores (q.k, the same order as the softmax
probabilities within a head). Here one set of positions is chosen per sequence per step, shared by every head, by
the attention probability each key receives summed over all the selection layer's query heads (the attention mass
the layer gives it). Positions persist across layers but heads do not correspond from one layer to the next (head
3 of layer 2 and head 3 of layer 7 are unrelated), so a per-head choice has no meaning for the layers that reuse
it; measured on SmolLM2-135M (3k tokens of license text, 48 teacher-forced decodes, budget 10%), the shared choice
gave a mean KL to full attention of 0.11 against 0.18 for a choice per KV head. One set per sequence also makes a
sparse layer's read one gather of contiguous (slot, all heads) rows. The ``window`` most recent positions (the
current token included, as in the paper's reference, which always keeps the last one) are always read; the top
``budget`` of the earlier positions join them. A row whose context is no longer than budget + window is not sparse
at all: it stays in the backend's ordinary full-attention batch, so its outputs are exact. Only decode rows (one
query, no token tree) are sparse; prefill and verification rows attend fully.

Positions are logical token indices, turned into cache slots through the sequence's block table once per selection,
so paged KV and shared prefix-cache blocks need nothing special. The state of one step (which rows, what was
selected) lives in the ``SparseStep`` the backend puts into ``meta.plan``: per step, never global. Not done here:
the paper's KV-cache correction (re-filling the KV of sparsely decoded tokens with full attention); their KV,
computed with sparse attention, is cached and prefix-shared like any other.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from leapdecode.attention.backend import AttentionMetadata
from leapdecode.config import SparseAttentionConfig


class SparseAttention:
    """One model's resolved settings; plans each step's sparse decode rows (``SparseStep``)."""

    def __init__(self, cfg: SparseAttentionConfig, num_layers: int) -> None:
        self.budget, self.window = cfg.budget, cfg.window
        self.selection_layers = frozenset(cfg.layers_for(num_layers))
        self.first_selection = min(self.selection_layers)

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
    """One step's sparse decode rows: dense attention below the first selection layer, dense attention plus a new
    selection at each selection layer, attention over the selected positions everywhere else."""

    def __init__(self, policy: SparseAttention, meta: AttentionMetadata, rows: list[int]) -> None:
        dev = meta.positions.device
        self.policy, self.rows = policy, rows
        lens = [meta.seq_lens_host[i] for i in rows]
        chosen = [policy.num_selected(n) for n in lens]
        self.max_len, self.num_chosen = max(lens), max(chosen)
        idx = torch.tensor(rows, device=dev)
        self.out_index = meta.query_start_loc[idx]                                    # the rows' query tokens
        self.block_size = meta.block_size
        self.blocks = meta.block_tables[idx, :-(-self.max_len // meta.block_size)]    # [B, nblocks]
        seq_lens = torch.tensor(lens, device=dev)
        key = torch.arange(self.max_len, device=dev)
        self.key_valid = key[None, :] < seq_lens[:, None]                             # [B, max_len]
        w = policy.window
        self.candidate = key[None, :] < (seq_lens[:, None] - w)                       # scored: before the window
        self.window_pos = seq_lens[:, None] - w + torch.arange(w, device=dev)        # [B, w]
        # the padded top-k slots of rows with fewer chosen positions are masked; the window is always valid
        chosen_valid = torch.arange(self.num_chosen, device=dev)[None, :] < torch.tensor(chosen, device=dev)[:, None]
        self.selected_valid = torch.cat([chosen_valid, torch.ones(len(rows), w, dtype=torch.bool, device=dev)], 1)
        self.positions: torch.Tensor | None = None     # [B, num_chosen + window] logical positions selected
        self._slots: torch.Tensor | None = None        # the same as cache slots, flat

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, layer: int | None) -> torch.Tensor:
        """q: the step's [T, H, D] queries -> [B, H, D] outputs of this step's sparse rows at ``layer``."""
        if layer is None:
            raise ValueError("sparse attention needs the layer index: call attend(..., layer=i)")
        q = q[self.out_index]
        if layer < self.policy.first_selection:
            return self._dense(q, kv_cache, scale)
        if layer in self.policy.selection_layers or self._slots is None:   # (a forward may skip a selection layer)
            return self._select(q, kv_cache, scale)
        return self._sparse(q, kv_cache, scale)

    def _gather_blocks(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value of the rows' contexts: [B, Hkv, max_len, D] each."""
        B, nb = self.blocks.shape
        _, _, bs, hkv, d = kv_cache.shape
        k, v = (kv_cache[i].index_select(0, self.blocks.flatten()).view(B, nb * bs, hkv, d)[:, :self.max_len]
                for i in (0, 1))
        return k.transpose(1, 2), v.transpose(1, 2)

    def _dense(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        k, v = self._gather_blocks(kv_cache)
        return _grouped_attention(q, k, v, self.key_valid, scale)

    def _select(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Full attention with its probabilities, from which the positions of the layers above are chosen."""
        k, v = self._gather_blocks(kv_cache)
        B, hkv, _, d = k.shape
        qg = q.view(B, hkv, -1, d).float()                                           # [B, Hkv, group, D]
        logits = torch.matmul(qg, k.float().transpose(-1, -2)) * scale               # [B, Hkv, group, max_len]
        probs = logits.masked_fill_(~self.key_valid[:, None, None], float("-inf")).softmax(-1)
        out = torch.matmul(probs, v.float()).view(B, -1, d).to(q.dtype)
        score = probs.sum((1, 2)).masked_fill_(~self.candidate, float("-inf"))      # [B, max_len], all heads
        self.positions = torch.cat([score.topk(self.num_chosen, -1).indices, self.window_pos], -1)
        blk = self.blocks.gather(1, self.positions // self.block_size)
        self._slots = (blk * self.block_size + self.positions % self.block_size).flatten()
        return out

    def _sparse(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention over the selected positions only: budget + window keys are read, not the whole context."""
        B, K = self.positions.shape
        _, nb, bs, hkv, d = kv_cache.shape
        k, v = (kv_cache[i].view(nb * bs, hkv, d).index_select(0, self._slots).view(B, K, hkv, d).transpose(1, 2)
                for i in (0, 1))
        return _grouped_attention(q, k, v, self.selected_valid, scale)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """One query per row: q [B, H, D] over k, v [B, Hkv, K, D] with keys ``valid`` [B, K] -> [B, H, D]. The query
    heads of a KV group are laid out as that group's queries, so keys are never repeated per head."""
    B, hkv, _, d = k.shape
    o = F.scaled_dot_product_attention(q.view(B, hkv, -1, d), k, v, attn_mask=valid[:, None, None], scale=scale)
    return o.view(B, -1, d)
