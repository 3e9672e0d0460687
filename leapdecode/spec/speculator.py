"""Speculation inside the normal step: ask the drafter, let the controller size the drafts, learn from results.

The speculator only *proposes*: it returns one draft tree per decoding sequence, which the scheduler copies into
the step plan (trimmed to the budget). The engine verifies drafts in the same forward pass and the same sampler
as plain decoding (``sampling/verifier.py``), so a sequence with no draft takes exactly the plain path.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence as Seq

from leapdecode.config import SpeculativeConfig
from leapdecode.spec.controller import Controller, StepTimeModel
from leapdecode.spec.drafter import DraftRequest
from leapdecode.spec.registry import make_drafter
from leapdecode.spec.tree import DraftTree

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, step_time: StepTimeModel | None = None) -> None:
        self.cfg = cfg
        if cfg.drafter is not None:
            self.drafter = cfg.drafter
        else:
            options = dict(cfg.options)
            if cfg.method in ("recycling", "auto"):
                options.setdefault("vocab_size", vocab_size)
            self.drafter = make_drafter(cfg.method, **options)
        self.controller = Controller(cfg.num_speculative_tokens, step_time) if cfg.adaptive else None
        self.num_proposals = 0
        self.drafter_seconds = 0.0       # total time inside the drafter (bounded: a sum, not a history)

    @property
    def wants_topk(self) -> bool:
        """Does the drafter learn from the target's top-k at verified positions (Token Recycling)?"""
        return bool(getattr(self.drafter, "wants_topk", False))

    def propose(self, decoding: list["Sequence"], rooms: list[int], other_tokens: int) -> dict[int, DraftTree]:
        """One draft per decoding sequence that has room for one; ``other_tokens``: tokens the step computes
        anyway besides the decodes' own (prefill chunks), for the controller's cost model."""
        reqs, seqs = [], []
        for seq, room in zip(decoding, rooms):
            room = min(self.cfg.num_speculative_tokens, room)
            if room > 0:
                reqs.append(DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, room))
                seqs.append(seq)
        if not reqs:
            return {}
        t0 = time.perf_counter()
        drafts = self.drafter.propose(reqs)
        self.drafter_seconds += time.perf_counter() - t0
        self.num_proposals += 1
        if self.controller is not None:
            keep = self.controller.draft_lengths(
                [(s.seq_id, len(d), d.score) for s, d in zip(seqs, drafts)], len(decoding) + other_tokens)
        else:
            keep = [len(d) for d in drafts]
        return {s.seq_id: DraftTree.of(d.tokens, d.parents).prefix(k)
                for s, d, k in zip(seqs, drafts, keep) if k > 0}

    def observe(self, seq: "Sequence", num_drafted: int, num_accepted: int, topk: Seq | None) -> None:
        if self.controller is not None:
            self.controller.observe(seq.seq_id, num_drafted, num_accepted)
        self.drafter.observe(seq.seq_id, seq.token_ids, num_accepted, topk)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if self.controller is not None:
            self.controller.step_time.observe(num_tokens, seconds)

    def finish(self, seq: "Sequence") -> None:
        self.drafter.finish(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)
