"""Grammar-aligned sampling: ASAp (Park et al., 2024, "Grammar-Aligned Decoding").

Plain constrained decoding samples x_i from P(x_i | x_<i) restricted to the grammar mask and renormalized at every
step. That is NOT the model's distribution conditioned on the grammar, P(x | x in L): the true conditional weighs
each next token by the expected future grammaticality (EFG) of the extended prefix,

    Q(x_i | x_<i)  ∝  P(x_i | x_<i) * EFG(x_<i x_i),    EFG(w) = sum over completions c of P(c | w) * [w c in L],

and the mask only knows whether EFG > 0. ASAp keeps, in a trie over sampled prefixes, an over-approximation of EFG:
an unvisited prefix the mask allows counts as 1; after each finished sample, every prefix on its path gets

    EFG_hat(w) = sum_x P(x | w) * EFG_hat(w x)      (disallowed x count 0, EOS in an accepting state counts 1),

using the masked next-token probabilities remembered at that node. Sampling with EFG_hat in place of EFG
converges to P(x | x in L) as the trie fills in; with an empty trie it is exactly plain constrained sampling.

Opt-in per request: the engine keeps one `AsapTrie` per (prompt, grammar) across repeated samples (n > 1 or
repeated calls), calls `reweight` instead of plain renormalization at each step and `update` after each sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["AsapTrie", "asap_reweight"]


@dataclass
class _Node:
    """A sampled prefix: the model's masked next-token probabilities there and the children seen so far."""

    efg: float = 1.0  # over-approximation of the expected future grammaticality of this prefix
    probs: torch.Tensor | None = None  # P(x | prefix) * mask, NOT renormalized (CPU float64)
    children: dict[int, _Node] = field(default_factory=dict)


class AsapTrie:
    """The learned EFG over-approximations for one (prompt, grammar); grows by one path per sample."""

    def __init__(self) -> None:
        self.root = _Node()
        self.num_samples = 0

    def _node(self, prefix: Sequence[int], create: bool) -> _Node | None:
        node = self.root
        for t in prefix:
            child = node.children.get(int(t))
            if child is None:
                if not create:
                    return None
                child = node.children[int(t)] = _Node()
            node = child
        return node

    def reweight(self, prefix: Sequence[int], probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The ASAp next-token distribution after `prefix` (a normalized tensor like `probs`).

        probs:   the model's next-token probabilities P(. | prefix), shape [V] (after temperature etc.).
        allowed: bool [V], the grammar mask for this position (see `bitmask_to_bool`).
        Remembers the masked probabilities at this prefix so that `update` can recompute its EFG later.
        """
        node = self._node(prefix, create=True)
        assert node is not None
        masked = torch.where(allowed.to(probs.device), probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
        node.probs = masked.detach().to("cpu", torch.float64)
        weights = masked.clone()
        for token, child in node.children.items():
            if token < weights.shape[0]:
                weights[token] = weights[token] * child.efg
        total = weights.sum()
        if not bool(total > 0):  # every allowed continuation learned to be hopeless: fall back to the mask
            weights, total = masked, masked.sum()
        return weights / total

    def update(self, tokens: Sequence[int]) -> None:
        """Fold a finished sample (its tokens, EOS included) into the EFG estimates along its path.

        The last node (after EOS, allowed only in an accepting state) keeps EFG 1, which is exact; a sample cut
        off by max_tokens leaves its last prefix at the over-approximation 1 as well.
        """
        path = [self.root]
        node = self.root
        for t in tokens:
            node = node.children.setdefault(int(t), _Node())
            path.append(node)
        for node in reversed(path[:-1]):
            if node.probs is None:
                continue
            efg = float(node.probs.sum())
            for token, child in node.children.items():
                if token < node.probs.shape[0]:
                    efg -= float(node.probs[token]) * (1.0 - child.efg)
            node.efg = max(efg, 0.0)
        self.num_samples += 1

    def efg(self, prefix: Sequence[int]) -> float:
        """Current EFG estimate of a prefix (1.0 for one never visited)."""
        node = self._node(prefix, create=False)
        return 1.0 if node is None else node.efg


def asap_reweight(trie: AsapTrie, prefix: Sequence[int], probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Functional form of `AsapTrie.reweight`."""
    return trie.reweight(prefix, probs, allowed)
