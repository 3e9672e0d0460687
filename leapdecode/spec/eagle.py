"""EAGLE-style draft head: one decoder layer over the target's own features, drafting chains and dynamic trees.

The head reads, at each position i, the pair (target feature f_i, embedding of the next token x_{i+1}), fuses them
with a linear layer 2d -> d and runs one Llama decoder layer (RMSNorm, attention with RoPE, gated MLP: the
building blocks of ``model/layers.py``) over the pairs, causally. Its output at pair i is a prediction of the
target's feature f_{i+1}; the target's own (frozen) LM head turns it into a distribution for x_{i+2}. Drafting
feeds the predicted feature back with the drafted token, so one committed prefix gives a chain or a tree.

Feature: the target's last hidden state *after* the final norm (the direct input of the LM head, HF numbering
``num_layers``: what EAGLE's reference code takes from the base model's output). The embedding and LM head are the
target's, bound at load time and never stored with the head. ``draft_vocab`` optionally restricts drafting to a
subset of the vocabulary (the most frequent tokens of the training data, as EAGLE-3 does): the head's LM head is
then the target's rows for those tokens, which makes the head's largest matmul several times cheaper on a CPU.

Position convention: pair i (feature of position i, token x_{i+1}) sits at RoPE position i. With committed tokens
x_0..x_n and target features f_0..f_{n-1} the head holds pairs 0..n-1; the output of pair n-1 predicts f_n and so
the first draft token x_{n+1}.

Files: an HF-style directory, ``config.json`` + ``model.safetensors`` (:meth:`EagleHead.save_pretrained`,
:meth:`EagleHead.from_pretrained`). :class:`EagleDrafter` keeps each sequence's head KV and drafts from it.
"""
from __future__ import annotations

import json
import math
import os
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from leapdecode.spec.draft_model import RowCost
from leapdecode.spec.drafter import Draft, DraftRequest, depth_pays
from leapdecode.spec.index import as_int_list
from leapdecode.spec.tree import DraftTree

HEAD_ARCHITECTURE = "LeapdecodeEagleHead"
_EMPTY = torch.empty(0, dtype=torch.int64)
_ONE_BLOCK = torch.zeros(1, 1, dtype=torch.int64)    # a head state's block table: its buffer is one block
NATIVE_ROWS = 24
"""Most pairs one call of the one-call layer takes (a step's catch-up, a short backlog): beyond, the module path,
whose int8 products go through fbgemm's int8 dot products, is faster (the shipped head on the 2-core Intel VM: 24
pairs 1.0 ms either way, 200 pairs 7.3 against 4.3 ms, 1,000 pairs 62 against 25 ms); fbgemm quantizes their
inputs, which cost the prompt's head KV next to nothing (a chain of 2: 1.71 tokens per step against 1.73)."""

INT8_LAYERS = ["qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
"""The head's matmuls drafted from int8 weights. Not ``fc``: its input is [the token's embedding, the target's
feature], and fbgemm quantizes a linear's input with one scale per call, which the feature's outlier dimensions
set: the embedding half came out flattened, and the shipped head's top-1 agreement with the target fell from 0.67
to 0.32 (teacher-forced; end to end on MT-Bench 1.22 tokens per step against 1.32 for the float head). The one-call
path (:meth:`EagleHead.native`) does take ``fc`` in int8: through the row kernel, weight-only (its inputs stay
float32), which left held-out acceptance unchanged (chains of 4, chat / math / code: 1.43 / 2.42 / 2.05 tokens per
step against 1.45 / 2.41 / 2.06 with a float ``fc``, 6 prompts per task, teacher-forced)."""


class HeadConfig:
    """``config.json`` of a draft head's directory: the dataclass's fields under ``architectures`` and
    ``model_type``; a subclass (a dataclass) sets ``ARCHITECTURE``, ``MODEL_TYPE`` and ``LABEL``."""

    ARCHITECTURE = MODEL_TYPE = LABEL = ""

    def to_json(self) -> dict:
        return {"architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, raw: dict):
        if cls.ARCHITECTURE not in (raw.get("architectures") or []):
            raise ValueError(f"not {cls.LABEL} config (architectures={raw.get('architectures')!r}, "
                             f"expected {cls.ARCHITECTURE!r})")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})


@dataclass
class EagleConfig(HeadConfig):
    ARCHITECTURE, MODEL_TYPE, LABEL = HEAD_ARCHITECTURE, "leapdecode_eagle", "an EAGLE head"

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int                      # the target's vocabulary
    draft_vocab_size: int | None = None  # None: draft over the whole vocabulary
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    feature_layer: str = "final_norm"    # which target hidden state the head reads (see the module docstring)
    target: dict = field(default_factory=dict)   # what the head was trained for (name, layers, ...), informative
    training: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, mc, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                   **extra) -> "EagleConfig":
        """A head shaped like one layer of the target ``mc`` (a ModelConfig)."""
        return cls(hidden_size=mc.hidden_size, intermediate_size=intermediate_size or mc.intermediate_size,
                   num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                   vocab_size=mc.vocab_size, draft_vocab_size=draft_vocab_size, rms_norm_eps=mc.rms_norm_eps,
                   rope_theta=mc.rope_theta, rope_scaling=mc.rope_scaling,
                   max_position_embeddings=max(mc.max_position_embeddings, 8192), **extra)



class HeadFiles(nn.Module):
    """A draft head's HF-style directory (``config.json`` + ``model.safetensors``) and what its users share: the
    draft vocabulary kept an integer tensor whatever the dtype move, the LM head rows' logits (int8 after
    :meth:`quantize_int8`), RoPE tables grown on demand. Subclasses set ``config_class`` (a :class:`HeadConfig`),
    ``label`` (for errors), ``INT8_LAYERS``, and have ``cfg``, ``draft_vocab``, ``rope``, ``lm_weight``, ``lm_int8``
    and an ``input_layernorm``. :class:`EagleHead` and the Kangaroo adapter (spec/kangaroo.py)."""

    config_class: type = type(None)
    label = "draft head"
    INT8_LAYERS: list[str] = []      # the matmuls :meth:`quantize_int8` turns to int8
    # (``lm_weight`` and ``lm_int8`` are set in each head's __init__: a class-level default would shadow the
    # submodule nn.Module registers when ``lm_int8`` is assigned, and the int8 rows would never be read)

    def save_pretrained(self, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**self.cfg.to_json(), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
                   for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "HeadFiles":
        from safetensors.torch import load_file
        with open(os.path.join(path, "config.json")) as f:
            cfg = cls.config_class.from_json(json.load(f))
        head = cls(cfg)
        state = load_file(os.path.join(path, "model.safetensors"))
        head.draft_vocab = torch.empty_like(state["draft_vocab"])
        head._vocab_list = None
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{cls.label} at {path}: missing {missing}, unexpected {unexpected}")
        return head.to(device=device, dtype=dtype)

    @classmethod
    def open(cls, path: str, method: str, train: str, dtype: torch.dtype, device: torch.device) -> "HeadFiles":
        """:meth:`from_pretrained`, with a ValueError naming the ``method`` and how to ``train`` one where ``path``
        holds no head."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"no {cls.label} at {path!r} (expected config.json and model.safetensors); train one "
                             f"with {train} or pass speculative_config={{'method': '{method}', 'model': DIR}}")
        return cls.from_pretrained(path, dtype=dtype, device=device)

    def to(self, *args, **kwargs):   # keep draft_vocab an integer tensor whatever the dtype move
        vocab = self.draft_vocab
        out = super().to(*args, **kwargs)
        out.draft_vocab = vocab.to(self.input_layernorm.weight.device)
        out._vocab_list = None
        return out

    def vocab_list(self) -> list[int]:
        """``draft_vocab`` as a Python list (cached): column j of :meth:`logits` is token ``vocab_list()[j]``."""
        if getattr(self, "_vocab_list", None) is None or len(self._vocab_list) != len(self.draft_vocab):
            self._vocab_list = self.draft_vocab.tolist()
        return self._vocab_list

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of the head's outputs; ``draft_vocab[j]`` is column j's token."""
        if self.lm_int8 is not None:
            return self.lm_int8(out)
        return F.linear(out.to(self.lm_weight.dtype), self.lm_weight).float()

    def quantize_int8(self) -> "HeadFiles":
        """Int8 weights for every matmul of drafting (``INT8_LAYERS``), the bound LM head rows included
        (``model/int8_linear.py``: 3-5x faster on a CPU, where drafting is bound by reading the weights). Lossless
        for the engine's output: verification decides every token, with the q this head really produced. Call after
        binding; CPU only."""
        from leapdecode.model import int8_linear
        if self.lm_weight is None:
            raise ValueError(f"bind the target's LM head before quantizing the {self.label}")
        int8_linear.quantize_linears(self, self.INT8_LAYERS)
        self.lm_int8 = int8_linear.Int8Linear(self.lm_weight)
        return self

    def _rope_tables(self, max_pos: int, device: torch.device) -> None:
        """The head's RoPE tables (``self.rope``) cover ``max_pos`` positions on ``device``."""
        if self.rope.max_positions < max_pos or self.rope.cos.device != device:
            self.rope.max_positions = max(max_pos, 2 * self.rope.max_positions, 512)
            self.rope.build(device)


class EagleHead(HeadFiles):
    config_class = EagleConfig
    label = "EAGLE head"
    INT8_LAYERS = INT8_LAYERS

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = GatedMLP(d, cfg.intermediate_size, False)
        self.rope = RotaryEmbedding(cfg.head_dim, 0, cfg.rope_theta, cfg.rope_scaling)
        n = cfg.draft_vocab_size or cfg.vocab_size
        self.register_buffer("draft_vocab", torch.arange(n), persistent=True)
        self.embed_weight: torch.Tensor | None = None    # the target's, bound by ``bind`` (not a parameter)
        self.lm_weight: torch.Tensor | None = None       # the target's LM head rows for ``draft_vocab``
        self.lm_int8: nn.Module | None = None            # the same rows in int8 (``quantize_int8``)

    # -- the target's frozen parts -----------------------------------------------------------------------------
    def bind(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> "EagleHead":
        """Use the target's embedding and LM head (frozen; the LM head cut to the draft vocabulary)."""
        if embed_weight.shape != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(f"the head was made for a target with vocab {self.cfg.vocab_size} and hidden size "
                             f"{self.cfg.hidden_size}, got an embedding of shape {tuple(embed_weight.shape)}")
        dtype = self.input_layernorm.weight.dtype
        self.embed_weight = embed_weight.detach()
        self.lm_weight = lm_head_weight.detach()[self.draft_vocab.to(lm_head_weight.device)].to(dtype).contiguous()
        return self

    def bind_target(self, model) -> "EagleHead":
        """Bind a leapdecode LlamaForCausalLM (tied or untied LM head)."""
        return self.bind(model.embed_tokens.weight, model.output_head.weight)

    # -- the forward pass --------------------------------------------------------------------------------------
    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pairs (feats[b, t], tokens[b, t]) at ``positions`` [B, T] -> (predicted next features [B, T, d], this
        call's keys and values [B, Hkv, T, D]). ``past``: keys/values of earlier pairs [B, Hkv, S, D]; ``mask``:
        bool [B or 1, 1, T, S + T] (True = may attend); None = causal over the new pairs, seeing all of ``past``."""
        B, T, _ = feats.shape
        c = self.cfg
        dtype = self.input_layernorm.weight.dtype       # the head's dtype (``fc`` may be an int8 layer)
        emb = F.embedding(tokens, self.embed_weight).to(dtype)
        x = self.fc(torch.cat([emb, feats.to(dtype)], dim=-1))
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self._rope_tables(int(positions.max()) + 1, x.device)
        q, k = self.rope(positions.reshape(-1), q.reshape(B * T, c.num_heads, c.head_dim),
                         k.reshape(B * T, c.num_kv_heads, c.head_dim))
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        k_all, v_all = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None and past is not None and past[0].shape[2] > 0:
            S = past[0].shape[2]
            mask = torch.ones(T, S + T, dtype=torch.bool, device=x.device)
            mask[:, S:] = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            mask = mask[None, None]
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, T, self.q_size))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v

    # -- the CPU's one-call layer -------------------------------------------------------------------------------
    def native(self, max_pos: int) -> tuple | None:
        """(weights, params, fc's row-kernel parts) for ``forward_native``, or None where the one-call layer
        (model/cpu_layer.py) cannot run this head: off the CPU, without the row kernel, or with a matmul it does
        not take (a float head's ``nn.Linear``; int8 heads qualify). ``max_pos``: the largest position the call
        will use (RoPE tables). Built once and kept until the head's matmuls or ``fc`` change (online training)."""
        self._rope_tables(max_pos + 1, self.input_layernorm.weight.device)
        mods = (self.qkv_proj, self.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        # (ids of objects the cached parts hold, so none of them can be freed and its id reused while cached)
        key = (id(self.rope.cos), *map(id, mods), id(self.fc), self.fc.weight._version,
               None if self.fc.bias is None else self.fc.bias._version)
        cached = self.__dict__.get("_native_parts")
        if cached is not None and cached[0] == key:
            return cached[1]
        parts = None
        from leapdecode.model import cpu_layer, int8_linear, packed_linear
        from leapdecode.model import layers as model_layers
        from leapdecode.attention import cpu_exact
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        linears = [cpu_layer.linear_parts(m) for m in mods]
        if (model_layers.FUSED_OPS and all(p is not None for p in linears) and isinstance(self.fc, nn.Linear)
                and all(w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() for w in norms)
                and packed_linear.float_rows() is not None and cpu_exact.kernel() is not None
                and self.fc.out_features % packed_linear.BLOCK == 0):
            c = self.cfg
            fc = int8_linear.Int8Linear(self.fc.weight, self.fc.bias).row_parts()   # weight-only int8
            parts = ([norms[0], *linears[0], *linears[1], norms[1], *linears[2], *linears[3], self.rope.cos,
                      self.rope.sin],
                     [float(c.rms_norm_eps), float(c.num_heads), float(c.num_kv_heads), float(c.head_dim),
                      1.0 / math.sqrt(c.head_dim)], fc)
        self.__dict__["_native_parts"] = (key, parts)
        return parts

    def forward_native(self, native: tuple, state: "HeadState", feats: torch.Tensor, tokens: torch.Tensor,
                       pos: int, row: int) -> torch.Tensor:
        """The head's layer over pairs (feats [T, d], tokens [T]) at positions ``pos`` .. ``pos + T - 1`` in one
        C++ call (model/cpu_layer.py's ``decoder_layer``): their keys and values are written to rows ``row`` ..
        ``row + T - 1`` of ``state.kv`` (room reserved by the caller), and each attends rows 0 .. its own, causally.
        Returns the predicted next features [T, d]. The same function as :meth:`forward` up to float rounding
        (exact attention kernel, row-kernel matmuls): drafts only, verification decides every token."""
        from leapdecode import native as native_kernels
        weights, params, fc = native
        T = tokens.shape[0]
        kernels = native_kernels.kernels()
        x = kernels.rows_linear_int8(torch.cat([F.embedding(tokens, self.embed_weight), feats], -1), *fc)
        mask = torch.ones(1, T, row + T, dtype=torch.bool)
        if T > 1:
            mask[0, :, row:] = torch.ones(T, T, dtype=torch.bool).tril()
        cap = state.kv.shape[1]
        step = [torch.arange(pos, pos + T), torch.arange(row, row + T), _EMPTY, _ONE_BLOCK, _EMPTY, mask, _EMPTY,
                _EMPTY]
        return kernels.decoder_layer(x, weights + [state.kv.view(2, 1, cap, *state.kv.shape[2:])], step, params)

# -- training loss (self-distillation, EAGLE) -------------------------------------------------------------------

def unroll_mask(T: int, step: int, device: torch.device) -> torch.Tensor:
    """Attention of unrolled step ``step`` (>= 2) of :func:`distill_loss`: [1, 1, T, step * T], True = may attend.
    Its query at position i stands for the head drafting token i + 1 after ``step - 1`` drafted pairs: it sees
    the committed pairs 0 .. i - step + 1 (step 1's keys, from the target's features) and the drafted pairs at
    i - step + 2 .. i (one from each later step's keys: step r's key at position i - (step - r))."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    blocks = [j <= i - step + 1] + [j == i - (step - r) for r in range(2, step + 1)]
    return torch.cat(blocks, 1)[None, None]


def unrolled(head: EagleHead, feats: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
             steps: int) -> list[torch.Tensor]:
    """The head's outputs [B, T, d] for pairs (feats[:, i], next_tokens[:, i]) at ``positions`` (0 .. T - 1), then
    ``steps`` - 1 more times on its own predictions: step s's output at position i is what the head drafting
    s tokens after committed pair i - s + 1 predicts there (``next_tokens`` standing for the drafted tokens)."""
    T = feats.shape[1]
    outs, past = [], None
    for step in range(1, steps + 1):
        if step == 1:
            out, k, v = head(feats, next_tokens, positions)
        else:
            prev = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], 1)   # position i reads the prediction at i - 1
            out, k, v = head(prev, next_tokens, positions, past, unroll_mask(T, step, feats.device))
        past = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        outs.append(out)
    return outs


def distill_loss(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                 noise: float = 0.0, w_cls: float = 0.1, cls_from: torch.Tensor | None = None,
                 unroll: int = 1, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on padded sequences: ``feats`` [B, T, d] target features f_0..f_{T-1}, ``tokens`` [B, T] the
    tokens x_0..x_{T-1}, ``valid`` [B, T] bool (right padding). Pair i = (f_i, x_{i+1}) predicts f_{i+1}: smooth-L1
    to the target's feature plus ``w_cls`` times the cross-entropy against the target's distribution (its LM head on
    f_{i+1}, over the draft vocabulary). ``noise``: uniform input noise on the features (EAGLE uses 0.1 of the
    feature scale) so the head tolerates its own predicted features when drafting. ``cls_from`` [B]: the
    cross-entropy only on pairs i >= cls_from[b] (e.g. the answer: the LM head is the costly part on a CPU).

    ``unroll`` > 1 trains the way the head drafts (EAGLE-3's "training-time test", HASS's aligned context): step
    s feeds the head its own step s - 1 predictions at every position, with the attention of a head s - 1 tokens
    deep into a draft (:func:`unroll_mask`), against the same targets; step s's loss is weighted ``decay`` ** (s -
    1). Without it the head only ever sees the target's features as input, yet from the second draft token on it
    reads its own."""
    B, T, _ = feats.shape
    inp = feats[:, :-1]
    if noise > 0:
        inp = inp + (torch.rand_like(inp) * 2 - 1) * noise
    pos = torch.arange(T - 1, device=feats.device).expand(B, -1)
    nxt = tokens[:, 1:]
    target = feats[:, 1:].to(head.input_layernorm.weight.dtype)
    mb = valid[:, 1:] & valid[:, :-1]
    sel = mb if cls_from is None else mb & (pos >= cls_from.to(pos.device)[:, None])
    with torch.no_grad():                  # the target's distribution, the same for every unrolled step
        p = torch.softmax(head.logits(target[sel]), -1)
        best = p.argmax(-1)
    pos_sel = pos[sel]
    total, parts = 0.0, {}
    for step, out in enumerate(unrolled(head, inp, nxt, pos, unroll), 1):
        m = (mb & (pos >= step - 1)).to(out.dtype)               # a position needs step - 1 earlier ones
        reg = (F.smooth_l1_loss(out, target, reduction="none").mean(-1) * m).sum() / m.sum().clamp_min(1)
        w = (pos_sel >= step - 1).to(out.dtype)
        logq = torch.log_softmax(head.logits(out[sel]), -1)
        nc = w.sum().clamp_min(1)
        ce = -((p * logq).sum(-1) * w).sum() / nc
        acc = ((best == logq.argmax(-1)).to(w.dtype) * w).sum().item() / nc.item()
        total = total + decay ** (step - 1) * (reg + w_cls * ce)
        tag = "" if step == 1 else f"_{step}"
        parts.update({f"reg{tag}": reg.item(), f"ce{tag}": ce.item(), f"top1{tag}": acc})
    return total, parts


# -- drafting ---------------------------------------------------------------------------------------------------

class HeadState:
    """One sequence's committed pairs in the head: the keys and values of pairs at positions ``base`` .. ``base +
    length - 1`` in rows 0 .. length - 1 of ``kv`` [2, capacity, Hkv, D] (keys, then values; the layout of a
    paged cache of one block, which the CPU's one-call layer reads in place), and the output of the last pair (the
    predicted next feature). Rows past ``length`` are free: a chain's draft pairs go there and are overwritten once
    pairs are committed. Appending writes in place and the buffer doubles when full, so a step's catch-up copies
    only its new pairs (a ``torch.cat`` of the whole state per step and per draft depth cost ~0.1 ms a call)."""

    __slots__ = ("kv", "length", "base", "last_out")

    def __init__(self, kv: torch.Tensor, length: int, base: int, last_out: torch.Tensor | None) -> None:
        self.kv, self.length, self.base, self.last_out = kv, length, base, last_out

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, base: int, last_out: torch.Tensor | None) -> "HeadState":
        """A state holding keys and values [1, Hkv, S, D]."""
        state = cls.empty(k.shape[1], k.shape[3], base, k.shape[2], k)
        state.append(k, v)
        state.last_out = last_out
        return state

    @classmethod
    def empty(cls, num_kv_heads: int, head_dim: int, base: int, capacity: int, like: torch.Tensor) -> "HeadState":
        """No pairs yet, room for ``capacity`` (at least 64), in ``like``'s dtype and device."""
        kv = like.new_empty(2, max(64, capacity), num_kv_heads, head_dim)
        return cls(kv, 0, base, None)

    @property
    def k(self) -> torch.Tensor:
        """The keys [1, Hkv, S, D] (a view)."""
        return self.kv[0, :self.length].permute(1, 0, 2).unsqueeze(0)

    @property
    def v(self) -> torch.Tensor:
        return self.kv[1, :self.length].permute(1, 0, 2).unsqueeze(0)

    @property
    def next_pos(self) -> int:
        return self.base + self.length

    def copy(self) -> "HeadState":
        return HeadState(self.kv.clone(), self.length, self.base, self.last_out)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows (committed pairs and a draft's scratch)."""
        if rows > self.kv.shape[1]:
            kv = self.kv.new_empty(2, max(rows, 2 * self.kv.shape[1]), *self.kv.shape[2:])
            kv[:, :self.length] = self.kv[:, :self.length]
            self.kv = kv

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append keys and values [1, Hkv, T, D] as committed pairs."""
        T = k.shape[2]
        self.reserve(self.length + T)
        self.kv[0, self.length:self.length + T] = k[0].transpose(0, 1)
        self.kv[1, self.length:self.length + T] = v[0].transpose(0, 1)
        self.length += T


@torch.no_grad()
def extend_state(head: EagleHead, state: HeadState | None, feats: torch.Tensor, next_tokens: Sequence[int],
                 start: int) -> HeadState:
    """Append committed pairs (feats[j], next_tokens[j]) at positions start + j (start must equal
    ``state.next_pos`` when a state is given). The state is extended in place (and returned)."""
    dev = head.draft_vocab.device
    T = len(next_tokens)
    c = head.cfg
    if state is None:
        state = HeadState.empty(c.num_kv_heads, c.head_dim, start, 2 * T, head.input_layernorm.weight)
    tok = torch.as_tensor(list(next_tokens), device=dev)
    native = head.native(start + T) if T <= NATIVE_ROWS else None
    if native is not None:
        state.reserve(state.length + T)
        out = head.forward_native(native, state, feats.to(dev), tok, start, state.length)
        state.length += T
        state.last_out = out[-1]
        return state
    out, k, v = head(feats.to(dev)[None], tok[None], torch.arange(start, start + T, device=dev)[None],
                     (state.k, state.v) if state.length else None)
    state.append(k, v)
    state.last_out = out[0, -1]
    return state


@torch.no_grad()
def draft_chains(head: EagleHead, states: Sequence[HeadState], depths: Sequence[int], stop_below: float = 0.0,
                 worth: Sequence[tuple[float, float]] | None = None, cost: RowCost | None = None
                 ) -> list[tuple[list[int], list[float]]]:
    """Greedy chains for several sequences at once: what ``draft(head, state, depth)`` gives for each (top-1 at
    every depth), one head forward per depth for the whole batch instead of one per sequence. The sequences'
    head KV (different lengths) is right-padded into one [B, Hkv, S, D] block and masked; each chain's own draft
    KV is appended after it (one sequence where the one-call layer runs: in place, :meth:`EagleHead.forward_native`).
    Returns per sequence (tokens, cumulative probabilities). ``stop_below``: stop once
    every chain that could still grow has a cumulative probability below it (a deeper token is less probable
    still: SpecDec++'s stopping rule; the head's cumulative probability tracks the acceptance rate closely).
    ``worth`` (per sequence, the seconds an accepted token saves and verifying one more costs:
    ``DraftRequest.token_seconds``, ``verify_seconds``) and ``cost`` (a draft depth's measured seconds per row, timed
    here): a chain also stops once one more depth does not pay (``drafter.depth_pays``, as draft_model's chains)."""
    B, dev = len(states), head.draft_vocab.device
    if B == 0:
        return []
    voc = head.vocab_list()
    native = head.native(states[0].next_pos + depths[0]) if B == 1 else None
    if native is not None:
        # one sequence through the one-call layer: each draft pair's keys and values go to the state's free rows
        # (scratch: the committed length does not move), so no copy of the state is made
        st = states[0]
        st.reserve(st.length + depths[0])
        out = st.last_out[None]

        def advance(out: torch.Tensor, tok: list[int], d: int) -> torch.Tensor:
            return head.forward_native(native, st, out, torch.tensor(tok, device=dev), st.next_pos + d - 1,
                                       st.length + d - 1)
    else:
        lens = [st.k.shape[2] for st in states]
        S = max(lens)
        Hkv, D = states[0].k.shape[1], states[0].k.shape[3]
        pk = states[0].k.new_zeros(B, Hkv, S, D)
        pv = pk.clone()
        for b, st in enumerate(states):
            pk[b, :, :lens[b]], pv[b, :, :lens[b]] = st.k[0], st.v[0]
        seen = torch.arange(S, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]     # [B, S]
        out = torch.stack([st.last_out for st in states])                                      # [B, d]
        base = torch.tensor([st.next_pos for st in states], device=dev)

        def advance(out: torch.Tensor, tok: list[int], d: int) -> torch.Tensor:
            # the pair (predicted feature, drafted token) at position next_pos + d - 1 predicts the next feature
            nonlocal pk, pv
            mask = torch.cat([seen, seen.new_ones(B, d)], 1)[:, None, None]                     # [B, 1, 1, S + d]
            o, k, v = head(out[:, None], torch.tensor(tok, device=dev)[:, None], (base + d - 1)[:, None],
                           (pk, pv), mask)
            pk, pv = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            return o[:, 0]
    toks: list[list[int]] = [[] for _ in range(B)]
    cum = torch.zeros(B, device=dev)
    probs: list[list[float]] = [[] for _ in range(B)]
    depth = max(depths)
    limit = list(depths)
    t_depth = time.perf_counter()
    for d in range(1, depth + 1):
        lp = torch.log_softmax(head.logits(out), -1)                                       # [B, V']
        val, idx = lp.max(-1)
        cum = cum + val
        tok = [int(voc[j]) for j in idx.tolist()]
        if cost is not None and d > 1:
            cost.observe(B, time.perf_counter() - t_depth)
        per_row = cost.per_row(B) if cost is not None and worth else None
        growing = 0.0                            # the most probable chain that may still grow
        for b, (t, c) in enumerate(zip(tok, torch.exp(cum).tolist())):
            if d <= limit[b]:
                toks[b].append(t)
                probs[b].append(c)
                if per_row is not None and not depth_pays(c, *worth[b], per_row):
                    limit[b] = d                 # one more depth costs more than this chain's next token is worth
                if d < limit[b]:
                    growing = max(growing, c)
        if d == depth or growing < stop_below or growing == 0.0:
            break
        t_depth = time.perf_counter()
        out = advance(out, tok, d)
    return list(zip(toks, probs))


@torch.no_grad()
def draft(head: EagleHead, state: HeadState, depth: int, top_k: int = 1, budget: int | None = None,
          dynamic: bool = True) -> tuple[DraftTree, list[float]]:
    """A draft from the head's state: with ``top_k=1`` a greedy chain of ``depth`` tokens; else an EAGLE-2 tree.

    Expansion: at each depth the ``top_k`` nodes with the highest cumulative log-probability (the head's
    confidence) are run through the head and each proposes its ``top_k`` best children. ``dynamic=True`` then keeps
    the ``budget`` nodes of highest cumulative probability among everything proposed (EAGLE-2's re-ranking: a deep
    branch survives only where the head is confident); ``dynamic=False`` keeps the fixed shape: the expanded
    frontier, ``top_k`` nodes per depth. Returns the tree, its nodes best first (by cumulative probability under
    the head, which never rises from a parent to its child, so the order is also topological and any prefix is
    the most probable subtree of its size among the kept nodes), and each node's cumulative probability."""
    budget = budget or depth * top_k
    if depth <= 0 or budget <= 0:
        return DraftTree(), []
    dev = state.k.device
    voc = head.vocab_list()
    S = state.k.shape[2]
    # candidate pool: (score, depth, parent pool index or -1, token); frontier: pool indices expanded next
    scores: list[float] = []
    depths: list[int] = []
    parents: list[int] = []
    tokens: list[int] = []
    lp = torch.log_softmax(head.logits(state.last_out[None]), -1)[0]
    top = torch.topk(lp, top_k)
    for s, j in zip(top.values.tolist(), top.indices.tolist()):
        scores.append(s), depths.append(1), parents.append(-1), tokens.append(int(voc[j]))
    frontier = list(range(len(tokens)))
    shape = list(frontier)                    # the fixed-shape tree: every depth's frontier
    feat_of = {-1: state.last_out}            # pool index -> its predicted feature (once it has been run)
    slot_of: dict[int, int] = {}              # pool index -> its row in the draft KV
    dk = state.k.new_zeros(1, state.k.shape[1], 0, state.k.shape[3])
    dv = dk
    anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)   # draft KV row i may see row j (ancestor or itself)
    for d in range(2, depth + 1):
        n, M = len(frontier), dk.shape[2]
        feats = torch.stack([feat_of[parents[i]] for i in frontier])[None]
        tok = torch.tensor([tokens[i] for i in frontier], device=dev)[None]
        pos = torch.full((1, n), state.next_pos + d - 2, device=dev)
        rows = torch.zeros(n, M + n, dtype=torch.bool, device=dev)
        for r, i in enumerate(frontier):
            if parents[i] >= 0:
                rows[r, :M] = anc[slot_of[parents[i]]]
            rows[r, M + r] = True
            slot_of[i] = M + r
        anc = torch.cat([torch.cat([anc, anc.new_zeros(M, n)], 1), rows], 0)
        mask = torch.cat([rows.new_ones(n, S), rows], 1)
        out, k, v = head(feats, tok, pos, (torch.cat([state.k, dk], 2), torch.cat([state.v, dv], 2)),
                         mask[None, None])
        for r, i in enumerate(frontier):
            feat_of[i] = out[0, r]
        dk, dv = torch.cat([dk, k], 2), torch.cat([dv, v], 2)
        lp = torch.log_softmax(head.logits(out[0]), -1)                   # [n, V']
        top = torch.topk(lp, top_k, dim=-1)
        cand = (torch.tensor([scores[i] for i in frontier], device=dev)[:, None] + top.values).flatten()
        order = torch.argsort(cand, descending=True).tolist()
        cand_l, idx_l = cand.tolist(), top.indices.tolist()
        new_ids = []
        for c in order:
            r, j = divmod(c, top_k)
            # (never above the parent's, whatever the rounding: the best-first order below stays topological)
            scores.append(min(cand_l[c], scores[frontier[r]])), depths.append(d), parents.append(frontier[r])
            tokens.append(int(voc[idx_l[r][j]]))
            new_ids.append(len(tokens) - 1)
        frontier = new_ids[:top_k]
        shape += frontier
    if top_k == 1:
        keep = list(range(min(budget, len(tokens))))
    elif dynamic:
        ranked = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))
        chosen: set[int] = set()
        keep = []
        for i in ranked:
            if len(keep) >= budget:
                break
            if parents[i] == -1 or parents[i] in chosen:
                chosen.add(i)
                keep.append(i)
    else:
        keep = shape[:budget]
    keep.sort(key=lambda i: (-scores[i], depths[i]))
    index = {i: j for j, i in enumerate(keep)}
    tree = DraftTree.of([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep])
    return tree, [math.exp(scores[i]) for i in keep]


# -- the drafter --------------------------------------------------------------------------------------------------

class HeadPrefixCache:
    """The head's keys/values of committed pairs, per chunk of ``CHUNK`` pairs, for sequences whose prompt prefix
    the engine's prefix cache serves: the engine computes no target features for cached blocks, so without this a
    head would draft from the first uncached position on, blind to the (often shared: system prompts) prefix.

    Chunk j holds pairs 16j .. 16j+15, whose keys/values depend on tokens x_0 .. x_{16j+16} only (pair i reads the
    feature of x_0..x_i and the token x_{i+1}); it is keyed by a hash chained over those tokens. Least recently
    used chunks are dropped beyond ``max_chunks``. After an online update of the head (spec/online.py) stored chunks
    are from the older weights: slightly worse drafts, never a wrong output."""

    CHUNK = 16

    def __init__(self, max_chunks: int = 1024) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = 0                    # chunks served

    @classmethod
    def _key(cls, previous: int, tokens: list[int], j: int) -> int:
        if j == 0:
            previous = hash(("eagle-prefix", tokens[0]))
        return hash((previous, tuple(tokens[cls.CHUNK * j + 1:cls.CHUNK * (j + 1) + 1])))

    def load(self, tokens: list[int], start: int) -> HeadState | None:
        """A state holding pairs 0 .. start-1 (``start`` a multiple of CHUNK), or None when a chunk is missing."""
        if start % self.CHUNK:
            return None
        ks, vs, key = [], [], 0
        for j in range(start // self.CHUNK):
            key = self._key(key, tokens, j)
            chunk = self._chunks.get(key)
            if chunk is None:
                return None
            self._chunks.move_to_end(key)
            ks.append(chunk[0])
            vs.append(chunk[1])
        self.hits += len(ks)
        return HeadState.of(torch.cat(ks, 2), torch.cat(vs, 2), 0, None)

    def store(self, state: HeadState, token_ids: Sequence[int], done: int, key: int) -> tuple[int, int]:
        """Put the chunks of ``state`` (base 0) not stored yet (``done`` of them were, the last with ``key``);
        returns the new (done, key)."""
        complete = state.next_pos // self.CHUNK
        if complete <= done:
            return done, key
        tokens = as_int_list(token_ids[:self.CHUNK * complete + 1])
        for j in range(done, complete):
            key = self._key(key, tokens, j)
            if key not in self._chunks:
                sl = slice(self.CHUNK * j, self.CHUNK * (j + 1))
                self._chunks[key] = (state.k[:, :, sl].clone(), state.v[:, :, sl].clone())
                if len(self._chunks) > self.max_chunks:
                    self._chunks.popitem(last=False)
        return complete, key


def _gather(entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The rows named by (block, row) entries, stacked: one slice per run of consecutive rows of one block."""
    parts, i = [], 0
    while i < len(entries):
        block, j = entries[i]
        k = i + 1
        while k < len(entries) and entries[k][0] is block and entries[k][1] == j + (k - i):
            k += 1
        parts.append(block[j:j + k - i])
        i = k
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def committed_rows(plan, result, h: torch.Tensor):
    """(seq_id, positions, rows of ``h``) for each sequence of a verified forward: ``h`` holds a hidden state for
    every token row of ``plan`` (the flat batch, sequences in plan order); the positions are every committed token
    of each chunk (prompt chunks included) and the draft nodes verification accepted, and their rows a new tensor
    (a slice's copy, or gathered where a tree's accepted nodes skip some), which the caller may keep."""
    off = 0
    for c in plan.seqs:
        n_committed = c.num_committed
        positions = list(range(c.start, c.start + n_committed))
        rows = list(range(off, off + n_committed))
        r = result.seqs.get(c.seq_id)
        if c.draft and r is not None and r.accepted:
            depths = c.draft.depths()
            last = c.start + n_committed - 1
            positions += [last + depths[j] for j in r.accepted]
            rows += [off + n_committed + j for j in r.accepted]
        if c.seq_id not in result.errors and rows:
            run = rows[-1] - rows[0] + 1 == len(rows)
            yield c.seq_id, positions, h[rows[0]:rows[-1] + 1].clone() if run else h[rows]
        off += c.num_new_tokens


class CommittedStates(ABC):
    """A draft head's per-sequence state over the target's hidden states of committed positions (EAGLE's features,
    Kangaroo's early states): ``observe_hidden`` keeps them (``capture_layers[0]``), ``_catch_up`` feeds the head the
    positions its state lacks through the subclass's ``_extend``, restarting from the longest run of known states
    (the prefix cache's chunks first) where some are missing, and ``_forget`` drops a finished sequence's."""

    capture_layers: tuple[int, ...] = ()

    def _init_states(self) -> None:
        self.states: dict[int, HeadState] = {}
        # seq_id -> position -> (a block of states [rows, d], the position's row in it): a step's rows stay one
        # block, read when the head catches up (after a forward every torch call is cold: a row view per position
        # cost ~30 us a decode step, ~1 us a prompt token)
        self.features: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        self.prefix = HeadPrefixCache()
        self._stored: dict[int, tuple[int, int]] = {}   # seq_id -> (chunks put in ``prefix``, the last one's key)

    def observe_hidden(self, plan, result, hidden: dict[int, torch.Tensor]) -> None:
        """After a verified forward: ``hidden[layer]`` holds the target's hidden state for every token row of
        ``plan``; keeps the committed positions' states (:func:`committed_rows`)."""
        if not self.capture_layers:
            return
        for seq_id, positions, feats in committed_rows(plan, result, hidden[self.capture_layers[0]]):
            self.add_features(seq_id, positions, feats)

    def add_features(self, seq_id: int, positions: Sequence[int], feats: torch.Tensor) -> None:
        """The target's hidden states (``capture_layers[0]``) of committed positions of one sequence (rows of
        ``feats``, which the drafter keeps: pass a tensor nothing else writes to)."""
        store = self.features.setdefault(seq_id, {})
        for j, p in enumerate(positions):
            store[int(p)] = (feats, j)

    @abstractmethod
    def _extend(self, seq_id: int, state: HeadState | None, feats: torch.Tensor, token_ids: Sequence[int],
                start: int, n: int) -> HeadState:
        """Positions start .. n - 1 (their states ``feats``) into ``state`` (None: a new one based at ``start``):
        each drafter's own head (EAGLE's pairs, Kangaroo's adapter keys)."""

    def _catch_up(self, seq_id: int, token_ids: Sequence[int]) -> HeadState | None:
        n = len(token_ids) - 1                      # pairs 0..n-1 need features f_0..f_{n-1}
        store = self.features.get(seq_id, {})
        state = self.states.get(seq_id)
        if state is not None and state.next_pos > n:  # rolled back (should not happen for committed tokens)
            state = None
        start = state.next_pos if state is not None else None
        if start is None or any(p not in store for p in range(start, n)):
            # fresh start from the longest run of known features that ends at n - 1
            if n - 1 not in store:
                self.states.pop(seq_id, None)
                return None
            start = n - 1
            while start - 1 in store:
                start -= 1
            # the engine's prefix cache computed no features for a cached prompt prefix: take the head's keys
            # and values of that prefix from an earlier sequence (exact: they depend on its tokens only)
            state = self.prefix.load(as_int_list(token_ids), start) if start > 0 else None
            self._stored.pop(seq_id, None)
        if start < n:
            state = self._extend(seq_id, state, _gather([store[p] for p in range(start, n)]), token_ids, start, n)
        for p in [p for p in store if p < n]:
            del store[p]
        self.states[seq_id] = state
        if state is not None and state.base == 0:
            self._stored[seq_id] = self.prefix.store(state, token_ids, *self._stored.get(seq_id, (0, 0)))
        return state

    def _forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        self.features.pop(seq_id, None)
        self._stored.pop(seq_id, None)


class EagleDrafter(CommittedStates):
    """Drafts from the head over the target's hidden states.

    The engine hands over the target's features of committed positions (:meth:`add_features`: prompt rows after a
    prefill chunk, the last committed token's and the accepted nodes' rows after a verify step); :meth:`propose`
    then extends each sequence's head state with the new committed pairs and drafts a chain (``top_k=1``) or an
    EAGLE-2 tree (``top_k > 1``, at most ``max_draft`` nodes, ``depth`` levels). A sequence whose features are
    missing (e.g. after preemption, until its recompute hands them over again) gets an empty draft. The state is
    dropped in :meth:`finish`.

    Each draft carries the head's cumulative probability of every node as its ``confidence`` (nodes best first):
    on the default model's held-out prompts it tracks the rate at which verification accepts the node's whole
    path within a few points per decile (benchmarks/README.md, "EAGLE under the controller at batch 1"), so the
    goodput controller prices each draft token by it rather than by a per-request average. Catching a sequence's
    head state up on pairs committed before the previous step (a new prompt, or tokens decoded while speculation
    was off) is reported as ``last_backlog_seconds``: a drafter that drafts every step does not pay it again, so
    the speculator does not charge it to the step as drafting cost."""

    STEADY_PAIRS = 2
    """Committed pairs per sequence a drafting step catches up on in the steady state (the bonus token, plus the
    accepted ones); catching up on more is backlog."""

    def __init__(self, head: EagleHead, depth: int = 6, top_k: int = 1, dynamic: bool = True,
                 feature_layer: int | None = None, online=None, stop_below: float = 0.02) -> None:
        """``online``: an :class:`~leapdecode.spec.online.OnlineDistiller` that keeps training ``head`` on the
        committed features it sees (None: the head is fixed). ``stop_below``: a chain stops growing once its
        cumulative probability is below this (0: always ``depth`` tokens)."""
        self.head, self.depth, self.top_k, self.dynamic = head, depth, top_k, dynamic
        self.stop_below = stop_below
        self.last_backlog_seconds = 0.0
        self.online = online
        self._lm_int8 = None             # with online training on int8: drafting reads an int8 copy of the head
        # time the last propose spent training (online): a bounded investment (OnlineConfig.max_share), which the
        # speculator does not charge as drafting cost, or the controller would turn off the head that is learning
        self.last_train_seconds = 0.0
        # the engine captures this hidden state (HF numbering; the target's num_layers = after the final norm)
        self.capture_layers: tuple[int, ...] = () if feature_layer is None else (feature_layer,)
        self._init_states()
        self.num_drafts = 0
        self.cost = RowCost()            # a chain's draft depth, seconds per row (the stopping rule's price)

    @classmethod
    def for_runner(cls, runner, model: str | None = None, num_speculative_tokens: int = 4, top_k: int = 1,
                   depth: int | None = None, dynamic: bool = True, int8: bool | None = None,
                   online: bool | dict = False, stop_below: float = 0.02) -> "EagleDrafter":
        """The drafter for ``speculative_config={"method": "eagle", ...}``: the head at ``model`` (default: the
        shipped SmolLM2-135M head) bound to the target in ``runner``; chains of ``num_speculative_tokens`` when
        ``top_k == 1``, else EAGLE-2 trees of ``depth`` levels (default 6) and up to ``num_speculative_tokens``
        nodes. ``int8``: the head's matmuls from int8 weights (default: on a CPU where that is measurably faster;
        lossless, see :meth:`EagleHead.quantize_int8`). ``online``: keep distilling the head on the served
        workload (True, or a dict of :class:`~leapdecode.spec.online.OnlineConfig` fields): the float head is
        trained, and with int8 drafting reads an int8 copy of it, made again after each update. ``stop_below``:
        a chain stops once its cumulative probability under the head is below this (0: never early)."""
        for name, v in (("num_speculative_tokens", num_speculative_tokens), ("top_k", top_k)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"eagle: {name} must be a positive integer, got {v!r}")
        if isinstance(stop_below, bool) or not isinstance(stop_below, (int, float)) or not 0 <= stop_below < 1:
            raise ValueError(f"eagle: stop_below must be a number in [0, 1), got {stop_below!r}")
        if depth is None:
            depth = num_speculative_tokens if top_k == 1 else 6
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"eagle: depth must be a positive integer, got {depth!r}")
        if not isinstance(online, (bool, dict)):
            raise ValueError(f"eagle: online must be a bool or a dict of OnlineConfig fields, got {online!r}")
        distiller_cfg = None
        if online is not False:
            from leapdecode.spec.online import OnlineConfig
            try:
                distiller_cfg = OnlineConfig(**(online if isinstance(online, dict) else {}))
            except TypeError as e:
                raise ValueError(f"eagle: bad online option: {e}") from None
        head = load_head_for(runner.model, model, runner.dtype, runner.device)
        from leapdecode.model import int8_linear
        use_int8 = int8_linear.choose(int8, runner.dtype, runner.device, head.lm_weight, "eagle") is not None
        if distiller_cfg is None:
            if use_int8:
                head.quantize_int8()
            return cls(head, depth, top_k, dynamic, feature_layer=runner.model_cfg.num_layers,
                       stop_below=float(stop_below))
        # online: the float head is trained; drafting reads an int8 copy of it, refreshed after each update
        from leapdecode.spec.online import OnlineDistiller
        drafter = cls(head, depth, top_k, dynamic, feature_layer=runner.model_cfg.num_layers,
                      online=OnlineDistiller(head, distiller_cfg), stop_below=float(stop_below))
        if use_int8:
            drafter._lm_int8 = int8_linear.Int8Linear(head.lm_weight)
            drafter.head = drafter._drafting_copy()
        return drafter

    def _drafting_copy(self) -> EagleHead:
        """An int8 copy of the trained head's matmuls (norms and buffers shared), for drafting."""
        from leapdecode.model import int8_linear
        head = int8_linear.int8_copy(self.online.head, INT8_LAYERS)
        head.lm_int8 = self._lm_int8
        return head

    def _behind(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Committed pairs the sequence's head state lacks."""
        state = self.states.get(seq_id)
        return len(token_ids) - 1 - (state.next_pos if state is not None else 0)

    def _extend(self, seq_id: int, state: HeadState | None, feats: torch.Tensor, token_ids: Sequence[int],
                start: int, n: int) -> HeadState:
        """Pairs start .. n - 1 (features ``feats``) into the head (and the online trainer's data)."""
        state = extend_state(self.head, state, feats, token_ids[start + 1:n + 1], start)
        if self.online is not None:
            self.online.add(seq_id, start, feats, token_ids[start:n])
        return state

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft() for _ in requests]
        chains: list[tuple[int, HeadState, int]] = []       # chains are drafted for all sequences at once
        self.last_backlog_seconds = 0.0
        for i, req in enumerate(requests):
            if req.max_draft <= 0:
                continue
            t0, behind = time.perf_counter(), self._behind(req.seq_id, req.token_ids)
            state = self._catch_up(req.seq_id, req.token_ids)
            if behind > self.STEADY_PAIRS:
                self.last_backlog_seconds += (time.perf_counter() - t0) * (1.0 - self.STEADY_PAIRS / behind)
            if state is None:
                continue
            depth = min(self.depth, req.max_draft)
            self.num_drafts += 1
            if self.top_k == 1:
                chains.append((i, state, depth))
                continue
            tree, probs = draft(self.head, state, depth, self.top_k, req.max_draft, self.dynamic)
            out[i] = Draft.from_tree(tree, score=probs[0] if probs else 0.0)
            out[i].confidence = probs
        if chains:
            worth = [(requests[i].token_seconds, requests[i].verify_seconds) for i, _, _ in chains]
            priced = any(w[0] for w in worth)
            for (i, _, _), (toks, probs) in zip(chains, draft_chains(self.head, [c[1] for c in chains],
                                                                      [c[2] for c in chains], self.stop_below,
                                                                      worth if priced else None, self.cost)):
                out[i] = Draft(toks, None, score=probs[0] if probs else 0.0, confidence=probs)
        self.last_train_seconds = 0.0
        if self.online is not None:
            t0 = time.perf_counter()
            if self.online.maybe_train() and self._lm_int8 is not None:
                self.head = self._drafting_copy()
            self.last_train_seconds = time.perf_counter() - t0
        return out

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        del seq_id, token_ids, num_accepted, topk

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._forget(seq_id)
        if self.online is not None:
            self.online.finish(seq_id)


def shipped_head_path() -> str:
    from leapdecode.assets import _ASSETS
    return str(_ASSETS / "eagle-smollm2-135m")


def load_head_for(model, head_path: str | None, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head at ``head_path`` (default: the shipped SmolLM2-135M head) bound to ``model``'s embedding/LM head."""
    path = head_path or shipped_head_path()
    head = EagleHead.open(path, "eagle", "scripts/train_draft_head.py", dtype, device)
    if head.cfg.vocab_size != model.cfg.vocab_size or head.cfg.hidden_size != model.cfg.hidden_size:
        raise ValueError(f"the EAGLE head at {path} was trained for a target with vocab {head.cfg.vocab_size} and "
                         f"hidden size {head.cfg.hidden_size}; this model has {model.cfg.vocab_size} and "
                         f"{model.cfg.hidden_size}")
    return head.bind_target(model).eval()


__all__ = ["EagleConfig", "EagleHead", "EagleDrafter", "CommittedStates", "HeadConfig", "HeadFiles", "HeadPrefixCache",
           "HeadState", "committed_rows", "distill_loss", "unrolled", "extend_state", "draft", "load_head_for",
           "shipped_head_path"]
