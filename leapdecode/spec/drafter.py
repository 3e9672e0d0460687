"""The one protocol every drafter implements, and the draft it returns.

A draft is either a chain (``parents is None``: token i follows token i-1, the first follows the request's last
committed token) or a tree given in topological order: ``parents[i]`` is the index of node i's parent in
``tokens``, or -1 when its parent is the request's last committed token. ``draft.tree`` is that shape as a
:class:`~leapdecode.spec.tree.DraftTree`, which answers every question about it. A draft without ``probs`` is a
point mass; verification stays lossless either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from leapdecode.spec.tree import DraftTree


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # None: a chain
    score: float = 0.0                # drafter's confidence in [0, 1] that its first token is accepted
    # optional: q as a [len(tokens), vocab] tensor on the target's device, row j the distribution token j was drawn
    # from (siblings of a tree: drawn without replacement from their shared row, listed in the order drawn);
    # verification then uses min(1, p/q) and the residual, recursively over siblings (sampling/rejection.py)
    probs: object | None = None
    # optional: per node, the estimated probability that its whole path is accepted (spec/calibration.py); nodes
    # then come best first, so a prefix of the draft is the most valuable draft of its size
    confidence: list[float] | None = None

    @staticmethod
    def from_tree(tree: DraftTree, score: float = 0.0, probs: object | None = None) -> "Draft":
        """A draft holding ``tree`` (lists; ``parents`` None for a chain)."""
        return Draft(list(tree.tokens), None if tree.parents is None else list(tree.parents), score, probs)

    @property
    def tree(self) -> DraftTree:
        """The draft's token tree (normalised: a chain given with explicit parents has ``parents`` None)."""
        return DraftTree.of(self.tokens, self.parents)

    @property
    def is_tree(self) -> bool:
        return not self.tree.is_chain

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DraftRequest:
    """What a drafter may look at: the committed tokens of one running sequence."""
    seq_id: int
    token_ids: Sequence[int]     # prompt + output, committed (no drafts)
    num_prompt_tokens: int
    max_draft: int               # at most this many draft tokens (tree nodes) for this request
    # for model drafters (spec/draft_model.py, spec/layer_skip.py); model-free drafters ignore them
    params: Any = None           # the request's SamplingParams: a drafter with probabilities processes q alike
    sample_index: int = 0        # the sample's index in its request (seeded draws are keyed by it)
    block_table: Sequence[int] = ()   # the target's KV blocks, holding the KV of every committed token but the last
    # seconds an accepted draft token saves on this machine now (0: not known), and what verifying one more token
    # adds to the step, accepted or not: a drafter that pays for each draft position stops once the next one does
    # not pay (:func:`depth_pays`; spec/draft_model.py, spec/eagle.py)
    token_seconds: float = 0.0
    verify_seconds: float = 0.0


def depth_pays(path_prob: float, token_seconds: float, verify_seconds: float, depth_seconds: float) -> bool:
    """SpecDec++'s stopping rule priced in seconds: one more draft depth is worth drafting when the chain's path
    probability (an upper bound on the next token's: a deeper token is less probable still) times what an accepted
    token saves covers what verifying one more token adds, which is paid whether it is accepted or not, plus what
    drafting the depth costs. (Charged only to accepted tokens, as this rule did before, the verification hardly
    ever stopped an EAGLE chain on the CPU, where a depth costs ~0.07 of a plain step to draft and ~0.15-0.2 to
    verify.)"""
    return path_prob * token_seconds >= verify_seconds + depth_seconds


class Drafter(Protocol):
    """A drafter may also set ``wants_topk = True`` to receive the target's top-k candidates in ``observe``."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request, each with at most ``max_draft`` tokens (may be empty)."""

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        """After a step: the sequence's committed tokens now, how many drafts were accepted, and optionally the
        target model's top-k candidates at each verified position (rows in order: last committed token, then
        each accepted draft position)."""

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The sequence ended; drop per-request state (and learn from its output, for global drafters)."""

    # Optional: ``offers(request) -> list[Offer]``, the candidate nodes with the evidence behind each, for the
    # calibrating chooser of ``auto`` (spec/calibration.py).
    # Optional: ``prepare(seq_id, token_ids)``, the committed tokens so far of a sequence still being prefilled, so a
    # drafter can index a long prompt chunk by chunk instead of all at once in its first ``propose`` (see
    # ``Speculator.prepare``).


class PerRequestDrafter:
    """Base for drafters that draft each request on its own and catch up with its committed tokens lazily in
    :meth:`propose`: subclasses implement :meth:`draft_one` (and :meth:`finish`); a request with no budget or
    fewer than ``min_context`` committed tokens gets an empty draft without asking it."""

    min_context = 1

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self.draft_one(req) if req.max_draft > 0 and len(req.token_ids) >= self.min_context else Draft()
                for req in requests]

    def draft_one(self, req: DraftRequest) -> Draft:
        raise NotImplementedError

    def prepare(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Catch up with a sequence's committed tokens ahead of its first draft (a prompt being prefilled chunk by
        chunk), so no single step pays for indexing a whole long prompt. Nothing to do by default."""
        del seq_id, token_ids

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int,
                topk: Sequence[Sequence[int]] | None = None) -> None:
        """Nothing to learn from the outcome: the request's state catches up in :meth:`propose`."""
        del seq_id, token_ids, num_accepted, topk
