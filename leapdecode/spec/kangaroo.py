"""Kangaroo: self-speculation through the target's first layers and a small trained adapter (issue 13).

    speculative_config={"method": "kangaroo", "num_speculative_tokens": k}            # the shipped adapter
    speculative_config={"method": "kangaroo", "model": DIR, "threshold": 0.4}        # another adapter

The draft of a token is the target's own first ``exit_layer`` layers (Kangaroo's shallow sub-network), then an
adapter trained to turn that early hidden state into the target's next-token distribution, then the target's LM
head (over the adapter's draft vocabulary). Each sequence stops drafting once the draft's confidence in its own
token falls below ``threshold`` (Kangaroo's second early exit; SpecDec++'s rule prices it, as for layer_skip).

**The adapter** (Kangaroo: "one multi-head attention and two normalization layers"): RMSNorm, one attention layer
with the target's head shapes and RoPE (over the early hidden states of the context), a residual, RMSNorm, then the
target's LM head rows for the draft vocabulary. Its output projection starts at zero and its last norm at the
target's final norm, so an untrained adapter is the plain early exit (the LM head on layer ``exit_layer``), and
training (scripts/train_draft_head.py ``--head kangaroo``) only has to add what the skipped layers would have
contributed; the loss is the cross-entropy against the target's own next-token distribution on its own answers.

**What is shared with the target, exactly.** The shallow layers read the target's KV cache for the committed prefix
and write their draft tokens' KV only to scratch blocks (spec/layer_skip.py, whose machinery this drafter is): the
target's cache is never written. Those layers compute, for a draft token, what the target computes for the same
token at the same position (the same weights over the same keys), so the adapter's keys of committed positions are
taken from the target's own forward: the engine captures the hidden state after ``exit_layer`` layers for every
committed row (``capture_layers``, as EAGLE's features), and the adapter's keys and values of a position depend on
that state alone (its attention reads the context's early states, not its own outputs), so catching up is two
small matmuls per new token. A prompt prefix that the engine's prefix cache served has no captured states; the
adapter's keys of such prefixes come from :class:`HeadPrefixCache` when an earlier request left them, else the
adapter attends from the first position it has (a shorter context for the draft, never a different output).

Verification is the target's as for every drafter (greedy: identical output; sampled: min(1, p/q) with the draft's
processed q), so the adapter changes only how many tokens a step accepts. What it costs: a draft token runs
``exit_layer`` of the target's layers, the adapter (a quarter of a layer) and the draft vocabulary's rows of the LM
head; see benchmarks/README.md ("Kangaroo") for acceptance and speed on the default model.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.model.layers import RMSNorm, RotaryEmbedding
from leapdecode.spec.drafter import Draft, DraftRequest
from leapdecode.spec.eagle import CommittedStates, HeadConfig, HeadFiles, HeadState
from leapdecode.spec.layer_skip import LayerSkipDrafter

ADAPTER_ARCHITECTURE = "LeapdecodeKangarooAdapter"


@dataclass
class AdapterConfig(HeadConfig):
    ARCHITECTURE, MODEL_TYPE, LABEL = ADAPTER_ARCHITECTURE, "leapdecode_kangaroo", "a Kangaroo adapter"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int                      # the target's vocabulary
    exit_layer: int                      # the adapter reads the residual stream after this many target layers
    draft_vocab_size: int | None = None  # None: draft over the whole vocabulary
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    target: dict = field(default_factory=dict)   # what it was trained for (name, layers, ...), informative
    training: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, mc, exit_layer: int, draft_vocab_size: int | None = None, **extra) -> "AdapterConfig":
        """An adapter shaped like the attention of the target ``mc`` (a ModelConfig)."""
        if not 1 <= exit_layer < mc.num_layers:
            raise ValueError(f"exit_layer must be in [1, {mc.num_layers}), got {exit_layer}")
        return cls(hidden_size=mc.hidden_size, num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads,
                   head_dim=mc.head_dim, vocab_size=mc.vocab_size, exit_layer=exit_layer,
                   draft_vocab_size=draft_vocab_size, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
                   rope_scaling=mc.rope_scaling, **extra)


class KangarooAdapter(HeadFiles):
    """See the module docstring. ``forward`` runs whole sequences (training); :meth:`kv` and :meth:`draft_rows`
    run a drafter's catch-up and draft positions over a :class:`HeadState`."""

    config_class = AdapterConfig
    label = "Kangaroo adapter"
    INT8_LAYERS = ["qkv_proj", "o_proj"]

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, d, bias=False)
        nn.init.zeros_(self.o_proj.weight)          # untrained: the plain early exit (module docstring)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, 0, cfg.rope_theta, cfg.rope_scaling)
        n = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("draft_vocab", torch.arange(n), persistent=True)
        self.lm_weight: torch.Tensor | None = None      # the target's LM head rows for ``draft_vocab``
        self.lm_int8: nn.Module | None = None            # the same rows in int8 (``quantize_int8``)

    def bind_target(self, model, init_norm: bool = False) -> "KangarooAdapter":
        """Use ``model``'s LM head (frozen, cut to the draft vocabulary); ``init_norm``: start the last norm from
        the target's final norm (a fresh adapter, before training)."""
        lm = model.output_head.weight
        if lm.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"the adapter was made for a target with vocab {self.cfg.vocab_size} and hidden size "
                             f"{self.cfg.hidden_size}, got an LM head of shape {tuple(lm.shape)}")
        if init_norm:
            with torch.no_grad():
                self.norm.weight.copy_(model.norm.weight.float())
        dtype = self.norm.weight.dtype
        self.lm_weight = lm.detach()[self.draft_vocab.to(lm.device)].to(dtype).contiguous()
        return self

    def _qkv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows h [N, d] at ``positions`` [N] -> q [N, H, D], k, v [N, Hkv, D] (RoPE applied)."""
        c = self.cfg
        q, k, v = self.qkv_proj(self.input_layernorm(h)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self._rope_tables(int(positions.max()) + 1, h.device)
        q, k = self.rope(positions, q.reshape(-1, c.num_heads, c.head_dim), k.reshape(-1, c.num_kv_heads, c.head_dim))
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences: early hidden states h [B, T, d] at ``positions`` [B, T] -> the adapter's output
        [B, T, d] (causal), the input of :meth:`logits`."""
        B, T, _ = h.shape
        c = self.cfg
        x = h.to(self.norm.weight.dtype)
        q, k, v = self._qkv(x.reshape(B * T, -1), positions.reshape(-1))
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.num_heads != c.num_kv_heads)
        return self.norm(x + self.o_proj(o.transpose(1, 2).reshape(B, T, self.q_size)))

    @torch.inference_mode()
    def kv(self, h: torch.Tensor, start: int, state: HeadState) -> None:
        """Append the keys and values of committed positions start .. start + len(h) - 1 (early hidden states
        h [T, d]) to ``state`` (start == state.next_pos)."""
        dtype = self.norm.weight.dtype
        _, k, v = self._qkv(h.to(dtype), torch.arange(start, start + h.shape[0], device=h.device))
        state.reserve(state.length + h.shape[0])
        state.kv[0, state.length:state.length + h.shape[0]] = k
        state.kv[1, state.length:state.length + h.shape[0]] = v
        state.length += h.shape[0]

    @torch.inference_mode()
    def draft_rows(self, h: torch.Tensor, positions: Sequence[int], states: Sequence[HeadState]) -> torch.Tensor:
        """Draft positions: row i (early hidden state h[i] at positions[i]) attends to its state's committed
        positions and its earlier draft positions (written past ``state.length``, left there as scratch) -> the
        adapter's outputs [N, d]."""
        c = self.cfg
        x = h.to(self.norm.weight.dtype)
        q, k, v = self._qkv(x, torch.as_tensor(list(positions), device=h.device))
        outs = []
        for i, (pos, st) in enumerate(zip(positions, states)):
            row = pos - st.base
            st.reserve(row + 1)
            st.kv[0, row], st.kv[1, row] = k[i], v[i]
            keys = st.kv[0, :row + 1].transpose(0, 1)[None]          # [1, Hkv, S, D]
            values = st.kv[1, :row + 1].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[i].unsqueeze(1)[None], keys, values,
                                               enable_gqa=c.num_heads != c.num_kv_heads)
            outs.append(o[0, :, 0].reshape(self.q_size))
        return self.norm(x + self.o_proj(torch.stack(outs)))


def shipped_adapter_path() -> str:
    from leapdecode.assets import _ASSETS
    return str(_ASSETS / "kangaroo-smollm2-135m")


def load_adapter_for(model, path: str | None, dtype: torch.dtype, device: torch.device) -> KangarooAdapter:
    """The adapter at ``path`` (default: the shipped SmolLM2-135M one) bound to ``model``'s LM head."""
    path = path or shipped_adapter_path()
    adapter = KangarooAdapter.open(path, "kangaroo", "scripts/train_draft_head.py --head kangaroo", dtype, device)
    c = adapter.cfg
    if (c.vocab_size, c.hidden_size) != (model.cfg.vocab_size, model.cfg.hidden_size) or \
            c.exit_layer >= model.cfg.num_layers:
        raise ValueError(f"the Kangaroo adapter at {path} was trained for a target with vocab {c.vocab_size}, hidden "
                         f"size {c.hidden_size} and more than {c.exit_layer} layers; this model has "
                         f"{model.cfg.vocab_size}, {model.cfg.hidden_size} and {model.cfg.num_layers}")
    return adapter.bind_target(model).eval()


class KangarooDrafter(CommittedStates, LayerSkipDrafter):
    """See the module docstring. ``model``: an adapter directory (default: the shipped one); ``threshold``: the
    early exit's confidence; ``int8``: the adapter's matmuls and LM head rows from int8 weights (default: where
    ``int8_linear.choose`` measures it faster; lossless, see ``HeadFiles.quantize_int8``). The target's first
    layers always run from the target's own weights: the adapter was trained on their states."""

    def __init__(self, runner, num_speculative_tokens: int = 4, model: str | None = None, threshold: float = 0.3,
                 int8: bool | None = None) -> None:
        from leapdecode.model import int8_linear
        adapter = load_adapter_for(runner.model, model, torch.float32, runner.device)
        n = runner.model_cfg.num_layers
        super().__init__(runner, num_speculative_tokens, skip=list(range(adapter.cfg.exit_layer, n)),
                         threshold=threshold, int8=False)
        if int8_linear.choose(int8, runner.dtype, runner.device, adapter.lm_weight, "kangaroo") is not None:
            adapter.quantize_int8()         # its own matmuls and LM head rows (a draft reads them every token)
        self.adapter = adapter
        self.exit_layer = adapter.cfg.exit_layer
        self.capture_layers: tuple[int, ...] = (self.exit_layer,)
        self.stats["caught_up"] = 0                  # committed positions whose keys the adapter took
        self._init_states()                          # the adapter's keys per sequence, fed by the early states

    # -- the adapter's keys of committed positions (CommittedStates._catch_up) --------------------------------------
    def _extend(self, seq_id: int, state: HeadState | None, feats: torch.Tensor, token_ids: Sequence[int],
                start: int, n: int) -> HeadState:
        if state is None:
            c = self.adapter.cfg
            state = HeadState.empty(c.num_kv_heads, c.head_dim, start, 2 * (n - start), self.adapter.norm.weight)
        self.adapter.kv(feats, start, state)
        self.stats["caught_up"] += n - start
        return state

    # -- drafting ------------------------------------------------------------------------------------------------
    @torch.inference_mode()     # (the states' buffers are made and written in inference mode only)
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        ready = []
        for r in requests:
            if r.max_draft > 0 and self._catch_up(r.seq_id, r.token_ids) is None:
                r = dataclasses.replace(r, max_draft=0)      # no early states yet (its first step): no draft
            ready.append(r)
        return super().propose(ready)

    @torch.inference_mode()
    def forward(self, chunks: list[tuple[int, Sequence[int], Sequence[int]]], layers: list[int],
                seq_ids: Sequence[int] = ()) -> torch.Tensor:
        hidden = self.hidden(chunks, layers, final_norm=False)
        out = self.adapter.draft_rows(hidden, [c[0] for c in chunks], [self.states[s] for s in seq_ids])
        logits = self.adapter.logits(out)
        if self.adapter.cfg.draft_vocab_size is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), -math.inf)
        full[:, self.adapter.draft_vocab] = logits
        return full

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._forget(seq_id)
        super().finish(seq_id, token_ids, num_prompt_tokens)


__all__ = ["AdapterConfig", "KangarooAdapter", "KangarooDrafter", "load_adapter_for", "shipped_adapter_path"]
