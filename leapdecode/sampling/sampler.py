"""Batched, vectorised sampling over logit rows.

A *row* is one position whose next token we need: the last token of a prefill, a decode position, or each position
of a speculative verification. Every row carries its sequence's parameters and the output it would have seen at
that position (for penalties and min_tokens), so verification rows are processed exactly as plain decoding would
process them. Random sampling uses the exponential-race form of Gumbel-max (argmax p / E, E ~ Exp(1)): no host
sync, and a seeded request draws its noise from its own generator, so its samples do not depend on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

import torch

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence


@dataclass
class Row:
    seq: "Sequence"
    history: Seq[int]           # draft tokens between the sequence's committed tokens and this row

    @property
    def num_output(self) -> int:
        return self.seq.num_output_tokens + len(self.history)


class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step."""

    def __init__(self, rows: list[Row], vocab_size: int, device: torch.device, eos_ids: set[int]) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        params = [r.seq.params for r in rows]
        self.all_greedy = all(p.greedy for p in params)
        if not self.all_greedy:     # one host-to-device copy for every per-row parameter
            packed = torch.tensor([[float(p.greedy) for p in params],
                                   [1.0 if p.greedy else p.temperature for p in params],
                                   [float(p.top_k if p.top_k > 0 else vocab_size) for p in params],
                                   [p.top_p for p in params], [p.min_p for p in params]],
                                  dtype=torch.float64).to(device)
            self.greedy = packed[0] != 0
            self.temperature = packed[1].float()
            self.top_k = packed[2].long()
            self.top_p, self.min_p = packed[3].float(), packed[4].float()
        self.use_top_k = any(0 < p.top_k < vocab_size for p in params)
        self.use_top_p = any(p.top_p < 1.0 for p in params)
        self.use_min_p = any(p.min_p > 0.0 for p in params)
        self.use_penalties = any(p.has_penalties for p in params)
        self.generators = [r.seq.generator for r in rows]
        # min_tokens: rows that may not stop yet get their stop tokens masked.
        self.stop_masks = [
            (i, sorted(set(r.seq.params.stop_token_ids) | (set() if r.seq.params.ignore_eos else eos_ids)))
            for i, r in enumerate(rows) if r.num_output < r.seq.params.min_tokens]
        self.max_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)

    # -- logits processing -------------------------------------------------------------------------------------
    def apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.use_penalties:
            return logits
        idx = [i for i, r in enumerate(self.rows) if r.seq.params.has_penalties]
        rows = [self.rows[i] for i in idx]
        V, dev = self.vocab_size, self.device
        out_tok = _padded([r.seq.output_token_ids + list(r.history) for r in rows], V, dev)
        all_tok = _padded([r.seq.token_ids + list(r.history) for r in rows], V, dev)
        counts = torch.zeros(len(rows), V + 1, device=dev).scatter_add_(
            1, out_tok, torch.ones_like(out_tok, dtype=torch.float32))[:, :V]
        seen = torch.zeros(len(rows), V + 1, dtype=torch.bool, device=dev).scatter_(1, all_tok, True)[:, :V]
        rep = torch.tensor([r.seq.params.repetition_penalty for r in rows], device=dev)[:, None]
        pres = torch.tensor([r.seq.params.presence_penalty for r in rows], device=dev)[:, None]
        freq = torch.tensor([r.seq.params.frequency_penalty for r in rows], device=dev)[:, None]
        sub = logits[idx]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)    # HF repetition penalty
        sub = sub - freq * counts - pres * (counts > 0).float()                     # OpenAI presence/frequency
        logits = logits.clone()
        logits[idx] = sub
        return logits

    def apply_stop_masks(self, logits: torch.Tensor) -> torch.Tensor:
        if self.stop_masks:
            logits = logits.clone()          # the raw rows are still needed for logprobs
        for i, tokens in self.stop_masks:
            logits[i, tokens] = float("-inf")
        return logits

    def to_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, then softmax. Greedy rows come out one-hot."""
        logits = logits / self.temperature[:, None]
        if self.use_top_k or self.use_top_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
            if self.use_top_k:
                ranks = torch.arange(logits.shape[-1], device=logits.device)
                drop |= ranks[None, :] >= self.top_k[:, None]
            if self.use_top_p:
                p = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
                drop |= (p.cumsum(-1) - p) >= self.top_p[:, None]      # keep the smallest set reaching top_p
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        if self.use_min_p:
            keep = probs >= self.min_p[:, None] * probs.max(-1, keepdim=True).values
            probs = (probs * keep).div_((probs * keep).sum(-1, keepdim=True))
        greedy_probs = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(self.greedy[:, None], greedy_probs, probs)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw logits -> what each row samples from: probabilities, or, when every row is greedy, the processed
        logits themselves (argmax needs no softmax, which is most of the sampler's cost at large vocabularies)."""
        logits = self.apply_stop_masks(self.apply_penalties(logits))
        return logits if self.all_greedy else self.to_probs(logits)

    # -- drawing -----------------------------------------------------------------------------------------------
    def exponential(self, num_rows: int | None = None, default: torch.Generator | None = None) -> torch.Tensor:
        """Exp(1) noise [R, V]; a seeded request's rows come from its own generator, in row order."""
        R = len(self.rows) if num_rows is None else num_rows
        q = torch.empty(R, self.vocab_size, device=self.device).exponential_(generator=default)
        for i, g in enumerate(self.generators[:R]):
            if g is not None:
                q[i].exponential_(generator=g)
        return q

    def sample(self, probs: torch.Tensor, default: torch.Generator | None = None) -> torch.Tensor:
        if self.all_greedy:
            return probs.argmax(-1)
        return (probs / self.exponential(default=default)).argmax(-1)


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists -> [R, max_len], padded with ``pad`` (an extra vocabulary column that is discarded)."""
    width = max((len(x) for x in lists), default=0) or 1
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, x in enumerate(lists):
        out[i, :len(x)] = torch.tensor(x, dtype=torch.long)
    return out.to(device)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw-model logprobs (before sampling transforms, as vLLM reports them): chosen token and top-N per row."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
    if num_top <= 0:
        return chosen, [[] for _ in chosen]
    vals, idx = lp.topk(num_top, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
