"""DoLa, decoding by contrasting layers (Chuang et al., "DoLa: Decoding by Contrasting Layers Improves Factuality in
Large Language Models", ICLR 2024, arXiv:2309.03883), per request: ``SamplingParams(dola_layers=...)``.

At each sampled row the final layer's distribution p_N is contrasted with an early exit p_j = softmax(lm_head(h_j))
of a "premature" layer j. Among the request's candidate layers the one whose early exit is farthest from p_N is
chosen (dynamic premature layer selection, paper §2.2), and the row's scores become (§2.3)

    log p_N(x) - log p_M(x)   for x in V_head = {x : p_N(x) >= 0.1 * max_w p_N(w)}   (adaptive plausibility)
    -inf                      elsewhere

which then go through the request's usual processing (logit bias, penalties, grammar mask, temperature, top-k/p,
seeds), sampled or taken greedily as usual. The paper recommends repetition_penalty=1.2 with it.

The semantics are those of transformers 4.x ``generate(dola_layers=...)`` (transformers 5 moved DoLa to the Hub):

- Candidates: "low" = every second layer of the lower half, "high" = of the upper half (``range(0, N//2, 2)``,
  ``range(N//2, N, 2)``; models deeper than 40 layers take ``range(0, 20, 2)`` and ``range(N-20, N, 2)``). With
  tied word embeddings the embedding output (layer 0) is skipped, since its early exit is nearly the identity:
  "low" starts at layer 2 (at 1 for 2-layer models). A list names layers explicitly (0 = embeddings, i = after
  layer i); transformers dropped indices >= N silently, we refuse them (``InvalidParameter``).
- The early exit applies the LM head to the residual stream **without** the final norm: transformers took
  ``lm_head(outputs.hidden_states[j])``, and a Llama's ``hidden_states[j]`` for j < N is taken before
  ``model.norm`` (``ModelRunner.execute(capture=...)`` uses the same numbering).
- The divergence is the one DoLa's code and transformers compute: with m = (p_N + p_j) / 2,
  0.5 * (KL(m || p_N) + KL(m || p_j)) averaged over the vocabulary (the textbook JSD takes KL(p || m)).
- transformers picks one layer per batch (the batch mean of the divergences); we pick per row, as the paper does
  per token. For a batch of one they agree, and here a request's tokens never depend on its batch.

With a grammar, V_head is taken among the tokens the grammar allows at that row (the threshold relative to the
most likely *allowed* token), so the contrast never leaves a row without an allowed token; the grammar's mask
still applies after the contrast. Draft rows of speculative decoding get the same transform as plain rows, so
verification stays exact (greedy output equals DoLa without speculation). Logprobs stay the model's own (final
layer), as vLLM reports raw logprobs: the contrast only decides which token is drawn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence as Seq

import torch

from leapdecode.errors import InvalidParameter

if TYPE_CHECKING:
    from leapdecode.engine.model_runner import ForwardOutput
    from leapdecode.engine.sequence import Sequence
    from leapdecode.engine.step import ScheduledSeq, StepPlan

RELATIVE_TOP = 0.1      # alpha of the adaptive plausibility constraint (paper and transformers)
MAX_HALF = 20           # a half spans at most this many layers (deeper than 40: the first or the last 20)
LayerSpec = str | Seq[int]


def candidate_layers(spec: LayerSpec, num_layers: int, tied: bool) -> tuple[int, ...]:
    """The premature layers a request contrasts with, in HF numbering; ``InvalidParameter`` naming ``dola_layers``
    when the model cannot serve ``spec``."""
    n = num_layers
    if isinstance(spec, str):
        start = 0 if not tied else 2 if n > 2 else 1 if n == 2 else 0
        deep = n > 2 * MAX_HALF
        if spec == "high":
            layers = range(n - MAX_HALF if deep else n // 2, n, 2)
        elif start == n // 2:
            layers = range(start, start + 1)
        else:
            layers = range(start, MAX_HALF if deep else n // 2, 2)
        if not layers:
            raise InvalidParameter(f"SamplingParams.dola_layers={spec!r} leaves no candidate layer for this model "
                                   f"({n} layers, tied embeddings: layer 0 skipped); name the layers",
                                   param="dola_layers")
        return tuple(layers)
    bad = [i for i in spec if not 0 <= i < n]
    if bad:
        raise InvalidParameter(f"SamplingParams.dola_layers must be layers in [0, {n}) for this model (0 = embeddings, "
                               f"i = after layer i; the final layer is the one contrasted against), got {bad}",
                               param="dola_layers")
    return tuple(dict.fromkeys(spec))


def divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """Per row, DoLa's Jensen-Shannon quantity 0.5 * (KL(m || p) + KL(m || q)) / V with m = (p + q) / 2, from
    log-probabilities [R, V] (0 * log 0 = 0, as in ``torch.nn.functional.kl_div``)."""
    m = 0.5 * (p_logprobs.exp() + q_logprobs.exp())
    m_log_m = torch.xlogy(m, m)
    return 0.5 * ((m_log_m - m * p_logprobs).mean(-1) + (m_log_m - m * q_logprobs).mean(-1))


def select_premature(final_logits: torch.Tensor, candidates: Seq[tuple[int, ...]],
                     early_logits: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """-> (log-softmax of each row's premature layer [R, V], that layer per row). ``candidates[r]``: row r's
    layers; ``early_logits(layer, rows)``: the early-exit logits of ``rows`` (an index tensor) at ``layer``.
    One layer's early exits at a time, so memory stays two [R, V] tensors however many candidates; ties keep the
    layer seen first (candidates in the order given, as argmax does)."""
    final_lp = final_logits.float().log_softmax(-1)
    best_lp = torch.empty_like(final_lp)
    best = torch.full((final_lp.shape[0],), float("-inf"), device=final_lp.device)
    chosen = torch.full((final_lp.shape[0],), -1, dtype=torch.long)
    for layer in dict.fromkeys(j for c in candidates for j in c):
        rows = torch.tensor([r for r, c in enumerate(candidates) if layer in c], dtype=torch.long)
        idx = rows.to(final_lp.device)
        lp = early_logits(layer, idx).float().log_softmax(-1)
        js = divergence(final_lp[idx], lp)
        take = ((js > best[idx]) | (chosen[rows] < 0).to(js.device)).nonzero().squeeze(1)
        best[idx[take]] = js[take]
        best_lp[idx[take]] = lp[take]
        chosen[rows[take.cpu()]] = layer
    return best_lp, chosen.tolist()


def contrast(final_logits: torch.Tensor, premature_logprobs: torch.Tensor,
             support_logits: torch.Tensor | None = None) -> torch.Tensor:
    """log p_N - log p_M on the plausible tokens (log p_N >= max + log 0.1, so the most likely token always stays),
    -inf elsewhere. ``support_logits``: the final logits with the grammar's mask applied, if any: the plausible set
    is then taken among allowed tokens (its maximum is the most likely allowed token)."""
    final_lp = final_logits.float().log_softmax(-1)
    head = final_lp if support_logits is None else support_logits.float().log_softmax(-1)
    plausible = head >= head.max(-1, keepdim=True).values + math.log(RELATIVE_TOP)
    return (final_lp - premature_logprobs).masked_fill_(~plausible, float("-inf"))


@dataclass(frozen=True)
class Premature:
    """The premature distributions of a step's DoLa rows, handed to the verifier with the logits."""
    rows: tuple[int, ...]            # sample rows (the plan's numbering) of DoLa requests
    logprobs: torch.Tensor           # [len(rows), V]: log-softmax of each row's premature layer
    layers: tuple[int, ...]          # the layer each row contrasted with

    def apply(self, final: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        """The sample rows' logits [S, V] -> the scores sampling uses: the DoLa rows contrasted, the others as they
        are. ``support``: the same rows with the grammar's mask applied (``final`` itself without a grammar)."""
        idx = torch.tensor(self.rows, dtype=torch.long, device=final.device)
        out = final.clone()
        out[idx] = contrast(final[idx], self.logprobs, None if support is final else support[idx])
        return out

    def of(self, c: "ScheduledSeq") -> "Premature | None":
        """One sequence's rows, numbered as if it were sampled alone (the verifier's per-sequence fallback)."""
        keep = [i for i, r in enumerate(self.rows) if c.sample_start <= r < c.sample_start + c.num_samples]
        if not keep:
            return None
        return Premature(tuple(self.rows[i] - c.sample_start for i in keep), self.logprobs[keep],
                         tuple(self.layers[i] for i in keep))


class LayerContrast:
    """The engine's side of DoLa: which hidden states a step must return, and the premature distributions of its
    DoLa rows. Nothing is captured or computed for a step without a DoLa request."""

    def __init__(self, lm_head: Callable[[torch.Tensor], torch.Tensor], num_layers: int, tied: bool) -> None:
        self.lm_head, self.num_layers, self.tied = lm_head, num_layers, tied
        self._layers: dict[str | tuple[int, ...], tuple[int, ...]] = {}

    def layers(self, spec: LayerSpec) -> tuple[int, ...]:
        key = spec if isinstance(spec, str) else tuple(spec)
        if key not in self._layers:
            self._layers[key] = candidate_layers(key, self.num_layers, self.tied)
        return self._layers[key]

    def capture(self, plan: "StepPlan", seqs: Mapping[int, "Sequence"]) -> tuple[int, ...]:
        """The hidden states this step's DoLa rows need (empty when no sampling sequence uses DoLa)."""
        specs = {seqs[c.seq_id].params.dola_layers for c in plan.seqs if c.samples} - {None}
        return tuple(sorted({j for s in specs for j in self.layers(s)}))

    def premature(self, plan: "StepPlan", seqs: Mapping[int, "Sequence"], fwd: "ForwardOutput",
                  all_rows: bool) -> Premature | None:
        """Choose each DoLa sample row's premature layer from ``fwd``'s hidden states: rows as the logits rows, or
        with ``all_rows`` one per token of the plan (when a drafter asked for every row)."""
        rows, logit_rows, hidden_rows, candidates = [], [], [], []
        offset = 0
        for c in plan.seqs:
            spec = seqs[c.seq_id].params.dola_layers if c.samples else None
            if spec is not None:
                first_logit = c.logits_start + c.num_logits - c.num_samples
                first_hidden = offset + c.num_new_tokens - c.num_samples if all_rows else first_logit
                rows += range(c.sample_start, c.sample_start + c.num_samples)
                logit_rows += range(first_logit, first_logit + c.num_samples)
                hidden_rows += range(first_hidden, first_hidden + c.num_samples)
                candidates += [self.layers(spec)] * c.num_samples
            offset += c.num_new_tokens
        if not rows:
            return None
        device = fwd.logits.device
        hidden_idx = torch.tensor(hidden_rows, dtype=torch.long, device=device)
        final = fwd.logits[torch.tensor(logit_rows, dtype=torch.long, device=device)]
        logprobs, layers = select_premature(
            final, candidates, lambda j, r: self.lm_head(fwd.hidden_states[j][hidden_idx[r]]))
        return Premature(tuple(rows), logprobs, tuple(layers))
