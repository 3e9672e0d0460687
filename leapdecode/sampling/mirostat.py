"""Mirostat: sampling that holds the surprise of the generated text at a target (perplexity control).

Basu, Ramachandran, Keskar and Varshney, "Mirostat: A Neural Text Decoding Algorithm that Directly Controls
Perplexity", ICLR 2021. Each sequence carries a threshold ``mu`` (it starts at 2 * tau); per token:

- v2 (Algorithm 2): keep the tokens whose surprise -log2 p is at most ``mu`` (always the most likely one);
- v1 (Algorithm 1): fit a Zipf exponent to the top m = 100 probabilities, s = sum t_i b_i / sum t_i^2 with
  t_i = ln((i + 1) / i) and b_i = ln(p_i / p_(i+1)), and keep the top k = (e 2^mu / (1 - N^-e))^(1/s) tokens,
  e = s - 1, N the vocabulary size (k rounded to the nearest integer, clamped to [1, N]);

then draw from the kept tokens renormalised, observe the drawn token's surprise s_obs = -log2 of its renormalised
probability, and move the threshold: mu <- mu - eta * (s_obs - tau). The probabilities are the row's after the
usual processing (logit bias, penalties, grammar mask, temperature); Mirostat replaces top-k/top-p/min-p.

``mu`` is per-sequence state that the sampler reads and never writes: the verifier reports each row's next
``mu`` in its ``SeqResult`` and the scheduler stores it on the ``Sequence``. Because the next token's truncation
depends on the previous draw, a Mirostat request takes no drafts and no overlapped step.
"""
from __future__ import annotations

import math

import torch

ZIPF_TOP_M = 100      # the paper's m: probabilities used to estimate the Zipf exponent (v1)


class MirostatRows:
    """The Mirostat rows of one sampling batch: which rows, their version, mu, tau and eta (float64)."""

    def __init__(self, rows: list[int], versions: list[int], mu: list[float], tau: list[float], eta: list[float],
                 device: torch.device) -> None:
        self.rows = rows
        packed = torch.tensor([mu, tau, eta], dtype=torch.float64).to(device)
        self.mu, self.tau, self.eta = packed[0], packed[1], packed[2]
        self.has_v1 = 1 in versions
        self.v1 = torch.tensor([v == 1 for v in versions], device=device)
        self.index = torch.tensor(rows, dtype=torch.long, device=device)

    def truncate(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs`` [R, V] with each Mirostat row's dropped tokens zeroed (unnormalised: the inverse-CDF draw
        renormalises); other rows unchanged."""
        sub = probs[self.index]
        keep = _surprise_mask(sub, self.mu)
        if self.has_v1:
            keep = torch.where(self.v1[:, None], _top_k_mask(sub, zipf_k(sub, self.mu)), keep)
        out = probs.clone()
        out[self.index] = sub * keep
        return out

    def next_mu(self, truncated: torch.Tensor, tokens: torch.Tensor) -> list[float]:
        """Each Mirostat row's mu after drawing ``tokens`` from ``truncated`` (what :meth:`truncate` returned)."""
        sub = truncated[self.index].double()
        chosen = sub.gather(1, tokens[self.index][:, None]).squeeze(1)
        surprise = -torch.log2(chosen / sub.sum(-1))
        return (self.mu - self.eta * (surprise - self.tau)).tolist()


def _surprise_mask(probs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """v2: tokens whose surprise -log2 p is at most mu, and always the most likely token."""
    keep = -torch.log2(probs.double()) <= mu[:, None]
    return keep.scatter_(1, probs.argmax(-1, keepdim=True), True)


def zipf_k(probs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """v1: the number of tokens to keep per row, from the Zipf exponent fitted to its top m probabilities.
    Pairs with a zero probability carry no information and are left out of the fit; a row with no usable pair
    keeps one token. Computed in log space so that a large mu gives k = N instead of an overflow."""
    R, V = probs.shape
    m = min(ZIPF_TOP_M, V)
    logp = probs.double().topk(m, dim=-1).values.log()                       # [R, m], descending
    i = torch.arange(1, m, dtype=torch.float64, device=probs.device)
    t = torch.log((i + 1) / i)                                                 # [m - 1]
    usable = torch.isfinite(logp[:, 1:])
    b = torch.where(usable, logp[:, :-1] - logp[:, 1:], 0.0)
    s_hat = (t * b).sum(-1) / (t * t * usable).sum(-1).clamp(min=1e-300)
    eps = s_hat - 1
    ln_n = math.log(V)
    ratio = torch.where(eps == 0, 1 / ln_n, eps / -torch.expm1(-eps * ln_n))  # e / (1 - N^-e) > 0; its limit at 0
    log_k = (ratio.log() + mu * math.log(2)) / s_hat.clamp(min=1e-300)
    k = torch.floor(log_k.clamp(max=ln_n).exp() + 0.5).clamp(1, V)
    return torch.where(usable.any(-1), k, 1.0).long()


def _top_k_mask(probs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The k most likely tokens of each row (ties in the order a stable descending sort gives)."""
    order = probs.sort(dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, ranks[None, :] < k[:, None])
