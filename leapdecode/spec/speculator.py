"""Speculation inside the normal step: ask the drafter, let the controller size the drafts, learn from results.

The engine verifies drafts itself (``leapdecode.sampling.rejection``) in the same forward pass and the same sampler
as plain decoding, so a request with no draft takes exactly the plain path.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.spec.controller import Controller, StepTimeModel
from leapdecode.spec.drafter import DraftRequest
from leapdecode.spec.registry import make_drafter

if TYPE_CHECKING:
    from leapdecode.engine.engine import Engine


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, engine: "Engine") -> None:
        self.cfg, self.engine = cfg, engine
        options = dict(cfg.options)
        if cfg.method in ("recycling", "auto"):
            options.setdefault("vocab_size", engine.vocab_size)
        self.drafter = make_drafter(cfg.method, **options)
        self.wants_topk = cfg.method in ("recycling", "auto")
        self.controller = Controller(cfg.num_speculative_tokens, _probe_step_time(engine)) if cfg.adaptive else None
        self.drafter_seconds: list[float] = []

    def propose(self, running: list[Sequence]) -> None:
        """Give each decoding request a draft for this step (possibly empty)."""
        eng = self.engine
        reqs, seqs = [], []
        for seq in running:
            seq.set_draft([])
            if seq.is_prefill or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            room = min(self.cfg.num_speculative_tokens, eng.draft_room(seq))
            if room > 0:
                reqs.append(DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, room))
                seqs.append(seq)
        if not reqs:
            return
        t0 = time.perf_counter()
        drafts = self.drafter.propose(reqs)
        self.drafter_seconds.append(time.perf_counter() - t0)
        if self.controller is not None:
            other = sum(1 for s in running if not s.is_prefill) + sum(
                s.num_tokens - s.num_computed_tokens for s in running if s.is_prefill)
            keep = self.controller.draft_lengths(
                [(s.seq_id, len(d), d.score) for s, d in zip(seqs, drafts)], other)
        else:
            keep = [len(d) for d in drafts]
        for seq, draft, k in zip(seqs, drafts, keep):
            if k > 0:
                seq.set_draft(draft.tokens[:k], draft.parents[:k] if draft.is_tree else None)

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int, topk: list[list[int]] | None) -> None:
        if self.controller is not None:
            self.controller.observe(seq.seq_id, num_drafted, num_accepted)
        self.drafter.observe(seq.seq_id, seq.token_ids, num_accepted, topk)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        if self.controller is not None:
            self.controller.step_time.observe(num_tokens, seconds)

    def finish(self, seq: Sequence) -> None:
        self.drafter.finish(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)


def _probe_step_time(engine: "Engine") -> StepTimeModel:
    """Time a 1-token and a larger forward on scratch blocks before any request exists, to seed the model."""
    from leapdecode.engine.scheduler import ScheduledSeq, SchedulerOutput
    from leapdecode.sampling_params import SamplingParams

    model = StepTimeModel()
    n_big = min(64, engine.cfg.max_num_batched_tokens, engine.max_model_len - 1)
    for n in (1, n_big, 1, n_big):
        seq = Sequence("__probe__", 0, [0] * n, SamplingParams())
        if not engine.block_manager.allocate(seq, n):
            break
        inputs = engine.runner.prepare(SchedulerOutput([ScheduledSeq(seq, n)], []), set())
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        engine.runner.execute(inputs).cpu()
        model.observe(n, time.perf_counter() - t0)
        engine.block_manager.free_seq(seq)
    return model
