"""Calibrated drafting: how likely is each draft token to be accepted, learned from what verification commits.

Every model-free drafter has some evidence behind each token it proposes (a suffix match of some length whose
continuations agree in some proportion; a successor of some rank in Token Recycling's matrix, seen after the same
two tokens some number of times), and some guess of what that evidence is worth. The guesses are not calibrated:
a 1-token suffix match whose occurrences all continue alike is "probability 1" to SuffixDecoding and right about a
third of the time on chat. Drafting every token whose guess clears a fixed bar verifies many tokens that fail
(``auto`` with ``fill`` verified 2.6-4.8 tokens per output token in replay), which a CPU pays for in full.

So each proposed node carries a *key* (the kind of evidence: drafter, source, match-length bucket, ...) and a
*prior* (the drafter's own estimate of P(node accepted | parent accepted)). :class:`AcceptanceModel` keeps, per
key, how often such nodes were accepted when their parent was: a Beta posterior around the prior, so an unseen key
trusts the drafter and a seen one trusts the record. It learns from **every** offered node, chosen or not, whose
parent path matches the committed tokens (the committed tokens of a step are the target's own, whatever was
drafted, so a node the step did not verify is still judged against them, up to the bonus token's depth). The
estimate is global (per workload, across requests, like the drafters' global caches) and forgets slowly
(``horizon``), so it follows a change of workload.

:func:`choose` merges the offers of several drafters into one tree (a path offered twice is one node), gives each
node the probability that its whole path is accepted, the product of its conditional estimates (two sources
proposing the same token are combined as independent evidence, 1 - prod(1 - p)), and keeps the most probable
nodes down to ``min_prob``, best first. Best first matters: the speculator's controller keeps a *prefix* of a
draft when verification is costly, and a prefix of a best-first draft is the most valuable draft of its size. The
draft's ``confidence`` holds those probabilities, so the controller values each token by it (spec/controller.py).

This is SpecDec++'s question (Huang et al. 2024: stop drafting when the predicted acceptance falls below a
threshold) answered without a model: the predictor is a table over the model-free evidence, fitted online.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from leapdecode.spec.drafter import Draft


@dataclass
class Offer:
    """Draft nodes one drafter offers, each with the evidence behind it. ``parents`` are topological (-1: the
    request's last committed token) and ``depths`` their depths (1: a child of the root); ``keys[i]`` names the
    kind of evidence for node i (a calibration bucket, see :func:`evidence`; None: not to be learnt from, nor are
    its descendants); ``priors[i]`` is the drafter's own
    estimate of P(node i accepted | its parent accepted)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    keys: list[Hashable] = field(default_factory=list)
    priors: list[float] = field(default_factory=list)

    @staticmethod
    def chain(tokens: list[int], key: int, prior: float) -> "Offer":
        """A chain whose node at depth d has the evidence ``key + depth_bucket(d)``."""
        depths = list(range(1, len(tokens) + 1))
        return Offer(tokens, list(range(-1, len(tokens) - 1)), depths, [key + depth_bucket(d) for d in depths],
                     [prior] * len(tokens))

    def __len__(self) -> int:
        return len(self.tokens)


def depth_bucket(depth: int) -> int:
    """Depths 1, 2, 3, then 4-6 and 7+: deep nodes are rare, so they share a bucket."""
    return depth if depth <= 3 else (4 if depth <= 6 else 7)



def evidence(kind: int, a: int = 0, b: int = 0) -> int:
    """An evidence key as an int (cheap to hash): a kind (which drafter and source, < 1000) and two fields
    (< 100 each), with the last two digits left for the node's :func:`depth_bucket` (added by the caller)."""
    return ((kind * 100 + a) * 100 + b) * 100


MERGED = 999
"""The kind of the chooser's own second-stage keys."""


class AcceptanceModel:
    """P(node accepted | parent accepted) per evidence key; see the module doc. ``strength``: how many
    observations the drafter's prior counts for; ``horizon``: a key's counts are halved when they pass it."""

    def __init__(self, strength: float = 4.0, horizon: float = 4096.0) -> None:
        if not strength > 0 or not horizon > 0:
            raise ValueError(f"strength and horizon must be positive, got {strength!r}, {horizon!r}")
        self.strength, self.horizon = float(strength), float(horizon)
        self._counts: dict[Hashable, list[float]] = {}      # key -> [accepted, judged]

    def estimate(self, key: Hashable, prior: float) -> float:
        c = self._counts.get(key)
        if c is None:
            return prior
        return (c[0] + self.strength * prior) / (c[1] + self.strength)

    def learn(self, offers: Sequence[Offer], committed: Sequence[int]) -> None:
        """Judge every offered node whose parent path equals the committed tokens (``committed``: the tokens the
        step committed after the drafts' root, accepted drafts then the bonus token)."""
        n = len(committed)
        counts, horizon = self._counts, self.horizon
        for offer in offers:
            hit = [False] * len(offer.tokens)
            for i, (tok, par, d, key) in enumerate(zip(offer.tokens, offer.parents, offer.depths, offer.keys)):
                if d > n or (par >= 0 and not hit[par]) or key is None:
                    continue
                ok = hit[i] = tok == committed[d - 1]
                c = counts.get(key)
                if c is None:
                    c = counts[key] = [0.0, 0.0]
                c[0] += ok
                c[1] += 1.0
                if c[1] > horizon:
                    c[0] *= 0.5
                    c[1] *= 0.5

    def snapshot(self) -> dict[Hashable, tuple[float, float]]:
        """(accepted, judged) per key, for benchmarks and tests."""
        return {k: (c[0], c[1]) for k, c in self._counts.items()}


def choose(offers: Sequence[Offer], model: AcceptanceModel, max_nodes: int,
           min_prob: float) -> tuple[Draft, Offer]:
    """One best-first draft from ``offers``: nodes whose path probability is at least ``min_prob``, the
    ``max_nodes`` most probable, each node's probability in ``confidence`` (see the module doc). Also returns the
    merged candidates as an offer of their own (evidence: the best source's estimate, how many sources agree, the
    rank among siblings, the depth), which the caller hands back to :meth:`AcceptanceModel.learn` with the offers."""
    counts, strength = model._counts, model.strength        # AcceptanceModel.estimate, inlined: the hot loop
    index: dict[int, int] = {}                   # (merged parent + 1) << 32 | token -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    best: list[float] = []                        # the highest conditional estimate any source gives the node
    agree: list[int] = []                         # how many sources offer it
    for offer in offers:
        local: list[int] = []
        for tok, par, d, key, prior in zip(offer.tokens, offer.parents, offer.depths, offer.keys, offer.priors):
            mp = local[par] if par >= 0 else -1
            ik = (mp + 1) << 32 | tok
            j = index.get(ik)
            c = counts.get(key)
            e = prior if c is None else (c[0] + strength * prior) / (c[1] + strength)
            if j is None:
                j = index[ik] = len(tokens)
                tokens.append(tok)
                parents.append(mp)
                depths.append(d)
                best.append(e)
                agree.append(1)
            else:
                if e > best[j]:
                    best[j] = e
                agree[j] += 1
            local.append(j)
    # second stage: sources overlap and compete (two sources offering one token are not independent evidence; a
    # sibling the sources rate higher makes a node less likely), so the merged node's conditional is calibrated
    # again, on what the merge sees
    n = len(tokens)
    rank = [0] * n
    groups: dict[int, list[int]] = {}
    for j, mp in enumerate(parents):
        groups.setdefault(mp, []).append(j)
    for group in groups.values():
        if len(group) > 1:                        # siblings: ranked by their best estimate
            for r, i in enumerate(sorted(group, key=lambda i: -best[i])):
                rank[i] = r
    keys: list[int | None] = []
    path: list[float] = []
    base = evidence(MERGED)
    for j in range(n):                            # merged nodes are topological: a parent is merged first
        mp = parents[j]
        if mp >= 0 and path[mp] < min_prob:       # so is this path: never drafted, and not learnt from
            keys.append(None)
            path.append(0.0)
            continue
        b, a, r, d = best[j], agree[j], rank[j], depths[j]
        key = base + (90000 if b >= 0.9 else int(b * 10) * 10000) + (3000 if a >= 3 else a * 1000) + \
            (200 if r >= 2 else r * 100) + depth_bucket(d)
        keys.append(key)
        c = counts.get(key)
        e = b if c is None else (c[0] + strength * b) / (c[1] + strength)
        path.append(e if mp < 0 else path[mp] * e)
    merged = Offer(tokens, parents, depths, keys, best)
    # best first; ties keep merge order, so a parent (merged before its children, at least as probable) precedes
    # them and every prefix of the order is a tree
    order = sorted((j for j in range(n) if path[j] >= min_prob), key=lambda j: -path[j])[:max(0, max_nodes)]
    if not order:
        return Draft(), merged
    out = {j: i for i, j in enumerate(order)}
    out_parents = [out[parents[j]] if parents[j] >= 0 else -1 for j in order]
    chain = all(p == i - 1 for i, p in enumerate(out_parents))
    first = min(1.0, sum(path[j] for j in order if parents[j] < 0))    # sibling roots are disjoint events
    return Draft([tokens[j] for j in order], None if chain else out_parents, first,
                 confidence=[path[j] for j in order]), merged


PROB_EDGES = (0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.96, 0.99)
"""Buckets of a model drafter's own probability of its token (:class:`ChainCalibration`): finer near 1, where a
draft model's tokens mostly are and where the difference between 0.9 and 0.99 decides how deep a draft pays."""


class ChainCalibration:
    """Calibrated confidences for a model drafter's chains (draft model, layer skipping).

    Such a drafter knows its own probability p_j of each token it drafts, and the running product of those was
    its claim that tokens 1..j are all accepted. That product is not calibrated: a self-draft that agrees with
    the target on ~91% of tokens (layer_skip, int8, SmolLM2-135M on code) claimed 0.1-0.5 a token, so the
    controller valued its drafts below their cost and switched it off. One scale on the whole claim (the
    controller's ``realized``) cannot fix that: the product's error grows with depth. So each token is valued by
    P(accepted | parent accepted) for its bucket of p_j, sampled or greedy (an :class:`AcceptanceModel`, prior
    p_j), and the draft's ``confidence`` is the running product of those. Depth is left out of the key: split by
    depth too, the buckets learnt too slowly to matter within the 48-token answers measured.

    Each draft is judged against the tokens committed after it, which are the target's whatever was verified:
    the tokens up to the first mismatch were (or would have been) accepted, the first mismatch was not. A draft
    is resolved once that is known, or when the next draft of its request replaces it (what is known so far),
    so a draft scored in the shadow of plain decoding teaches the deep levels too."""

    def __init__(self, kind: int = 1, strength: float = 4.0, horizon: float = 4096.0) -> None:
        self.kind = kind
        self.model = AcceptanceModel(strength, horizon)
        self._pending: dict[int, tuple[int, Offer]] = {}        # seq_id -> (committed tokens when drafted, offer)

    def key(self, p: float, sampled: bool) -> int:
        b = 0
        while b < len(PROB_EDGES) and p >= PROB_EDGES[b]:
            b += 1
        return evidence(self.kind, b, int(sampled))

    def estimate(self, p: float, sampled: bool) -> float:
        """P(a token drafted with probability ``p`` is accepted | its parent is)."""
        return self.model.estimate(self.key(p, sampled), p)

    def confidences(self, seq_id: int, token_ids: Sequence[int], tokens: Sequence[int], probs: Sequence[float],
                    sampled: Sequence[bool]) -> list[float]:
        """The calibrated path probabilities of a chain drafted after the committed ``token_ids`` (``probs``: the
        drafter's probability of each of its tokens); the chain waits to be judged (:meth:`observe`)."""
        self.finish(seq_id, token_ids)
        keys = [self.key(p, s) for p, s in zip(probs, sampled)]
        offer = Offer(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)), keys,
                      [float(p) for p in probs])
        path, out = 1.0, []
        for key, p in zip(keys, offer.priors):
            path *= self.model.estimate(key, p)       # (:meth:`estimate`, the key already made)
            out.append(path)
        if tokens:
            self._pending[seq_id] = (len(token_ids), offer)
        return out

    def observe(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Judge the request's pending chain once the committed tokens decide it."""
        item = self._pending.get(seq_id)
        if item is None:
            return
        start, offer = item
        truth = token_ids[start:start + len(offer.tokens)]
        m = 0
        while m < len(truth) and truth[m] == offer.tokens[m]:
            m += 1
        if m < len(truth) or m == len(offer.tokens):
            del self._pending[seq_id]
            self.model.learn([offer], list(truth))

    def finish(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Judge the request's pending chain on what its committed tokens have shown so far, and drop it."""
        item = self._pending.pop(seq_id, None)
        if item is not None:
            start, offer = item
            self.model.learn([offer], list(token_ids[start:start + len(offer.tokens)]))
