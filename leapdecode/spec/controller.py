"""How many draft tokens to verify, per request and for the batch: speculate where it pays, not where it costs.

Two ideas combined:
- per request (SpecDec++-style): each request keeps a running estimate alpha of the chance that its next draft
  token is accepted (a decayed Beta posterior over its own history, seeded by the drafter's score); the j-th draft
  token of a chain is then worth alpha^j expected tokens, so an unlikely continuation is cut early;
- for the batch (SmartSpec's goodput): a step costs about c0 + c1 * (tokens in the step), a linear model fitted
  online from measured steps (and a probe at start-up). Draft tokens are admitted greedily, most valuable first,
  while expected emitted tokens per second keeps rising. Under heavy load, or with poor acceptance, nothing is
  admitted and the step is exactly plain decoding.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class StepTimeModel:
    """t(n) = c0 + c1 * n seconds for a step of n tokens, by least squares with exponential forgetting."""
    c0: float = 1e-3
    c1: float = 1e-5
    decay: float = 0.98
    _sw: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self._sw = d * self._sw + 1
        self._sx = d * self._sx + num_tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + num_tokens * num_tokens
        self._sxy = d * self._sxy + num_tokens * seconds
        var = self._sw * self._sxx - self._sx ** 2
        if var > 1e-9 * max(self._sw * self._sxx, 1.0):
            slope = (self._sw * self._sxy - self._sx * self._sy) / var
            self.c1 = max(slope, 1e-9)
            self.c0 = max((self._sy - self.c1 * self._sx) / self._sw, 1e-6)

    def __call__(self, num_tokens: int) -> float:
        return self.c0 + self.c1 * num_tokens


@dataclass
class _Acceptance:
    accepted: float
    rejected: float

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class Controller:
    def __init__(self, max_draft: int, step_time: StepTimeModel | None = None, decay: float = 0.9,
                 prior_strength: float = 2.0, min_gain: float = 0.0) -> None:
        self.max_draft = max_draft
        self.step_time = step_time or StepTimeModel()
        self.decay, self.prior_strength, self.min_gain = decay, prior_strength, min_gain
        self._acc: dict[int, _Acceptance] = {}

    def alpha(self, seq_id: int, score: float = 0.5) -> float:
        """Per-token acceptance estimate: the request's own history, shrunk toward the drafter's score."""
        a = self._acc.get(seq_id)
        s = min(max(score, 0.02), 0.98) * self.prior_strength
        prior = (s, self.prior_strength - s)
        if a is None:
            return prior[0] / self.prior_strength
        return (a.accepted + prior[0]) / (a.accepted + a.rejected + self.prior_strength)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """A chain of k drafts with a accepted is a successes and, if a < k, one failure."""
        if num_drafted == 0:
            return
        a = self._acc.setdefault(seq_id, _Acceptance(0.0, 0.0))
        a.accepted = self.decay * a.accepted + num_accepted
        a.rejected = self.decay * a.rejected + (1.0 if num_accepted < num_drafted else 0.0)

    def forget(self, seq_id: int) -> None:
        self._acc.pop(seq_id, None)

    def draft_lengths(self, proposals: list[tuple[int, int, float]], other_tokens: int) -> list[int]:
        """proposals: (seq_id, draft length on offer, drafter score) per decoding request; other_tokens: tokens the
        step computes anyway (one per decode, plus prefill chunks). Returns how many draft tokens to keep each."""
        keep = [0] * len(proposals)
        alphas = [self.alpha(sid, score) for sid, _, score in proposals]
        # candidate j (1-based) of request i is worth alpha_i^j; admit the best first while goodput rises
        heap = [(-a, i, 1) for i, ((_, n, _), a) in enumerate(zip(proposals, alphas)) if n > 0]
        heapq.heapify(heap)
        tokens = other_tokens
        expected = float(len(proposals))          # every decode emits its bonus token
        best = expected / self.step_time(tokens)
        while heap:
            neg_gain, i, j = heapq.heappop(heap)
            gain = -neg_gain
            cand = (expected + gain) / self.step_time(tokens + 1)
            if cand <= best * (1 + self.min_gain):
                break                              # later candidates are worth less: stop here
            expected, tokens, best = expected + gain, tokens + 1, cand
            keep[i] = j
            if j < min(proposals[i][1], self.max_draft):
                heapq.heappush(heap, (-(gain * alphas[i]), i, j + 1))
        return keep
