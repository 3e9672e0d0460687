"""Lossless verification of drafts (chains and token trees).

Point-mass drafts (every model-free drafter) are verified by *sample, then match*: at each verified position draw
the target's token y exactly as plain decoding would (same processing, same sampler); if y is one of the draft's
children there, that child is accepted and we descend, otherwise y itself is the bonus token and we stop. For one
child x this accepts with probability p(x) and, on rejection, y is distributed as p with x removed and
renormalised: the standard speculative-sampling rule, and it stays exact with several children (a tree), since y
is always a true sample from p. Greedy is the special case y = argmax p. With no draft it is plain decoding.
The walk itself is ``DraftTree.walk`` (spec/tree.py); the batched driver is ``sampling/verifier.py``.

Drafts that carry their own distributions q (draft models) use the classic rule instead: accept x with
probability min(1, p(x)/q(x)); on rejection sample from normalize(max(p - q, 0)) (Leviathan et al. 2023).
"""
from __future__ import annotations

import torch


def verify_with_draft_probs(p: torch.Tensor, q: torch.Tensor, draft: list[int], generator: torch.Generator | None
                            ) -> tuple[int, int]:
    """Chain drafts with draft distributions. p: [k + 1, V] target, q: [k, V] draft -> (num accepted, next token)."""
    k = len(draft)
    idx = torch.arange(k, device=p.device)
    x = torch.tensor(draft, device=p.device)
    ratio = (p[idx, x] / q[idx, x].clamp_min(1e-20)).clamp(max=1.0)
    u = torch.rand(k, device=p.device, generator=generator)
    rejected = (u >= ratio).nonzero()
    if len(rejected) == 0:
        return k, int(torch.multinomial(p[k], 1, generator=generator))
    j = int(rejected[0])
    residual = (p[j] - q[j]).clamp_min(0)
    if residual.sum() <= 0:            # p == q up to rounding: the residual is empty, p itself is exact
        residual = p[j]
    return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
