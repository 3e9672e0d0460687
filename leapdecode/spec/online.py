"""Online distillation of the EAGLE head while serving (Online Speculative Decoding, Liu et al. 2023).

A draft head trained offline on one mix of prompts drafts worse on a workload it has not seen (another language, a
code base, a house style). The engine already has, for every committed token, exactly what the head learns from:
the target's feature (its last hidden state, handed to the drafter for drafting anyway) and the token itself. So
while serving, :class:`OnlineDistiller` keeps short windows of recent committed (feature, token) runs and, every
few drafting calls, takes one optimizer step of the head's own training loss
(:func:`~leapdecode.spec.eagle.distill_loss`: predict the next feature, and the target's next-token distribution
through the frozen LM head) on the most recent windows. The head is only ever a drafter: whatever it learns,
verification decides every token, so the output is the same with it on or off (greedy identical; under sampling
the draft's q is the head's at drafting time).

Budget: a step costs a forward and backward over ``batch * window`` pairs (on SmolLM2-135M's head, 4 x 32 pairs:
tens of ms on a CPU), taken once per ``every`` drafting calls. ``max_share`` caps training at that share of the
wall time since the distiller started (measured, not assumed), so a slow machine trains less rather than decoding
slower. The drafter reports the time apart (``EagleDrafter.last_train_seconds``) and the speculation controller
does not charge it as drafting cost: it is an investment the user opted into, bounded by ``max_share``; charged
per step, it made the controller turn off the head that was learning (benchmarks/README.md).

Sequence state that the head computed before an update (its per-sequence keys/values) is kept: it came from the
previous weights, which only makes those drafts slightly worse until the sequence's next tokens, never wrong.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from leapdecode.spec.eagle import EagleHead, distill_loss


@dataclass
class OnlineConfig:
    lr: float = 3e-4            # AdamW learning rate (offline training uses 1e-3 from scratch)
    window: int = 32            # committed pairs per training window
    batch: int = 4              # windows per step (the most recent ones)
    every: int = 8              # drafting calls between steps
    buffer: int = 64            # windows kept
    noise: float = 0.1          # input noise on the features, as a share of their mean magnitude (as offline)
    w_cls: float = 0.1          # weight of the next-token cross-entropy (as offline)
    max_share: float = 0.1      # at most this share of wall time spent training

    def __post_init__(self) -> None:
        for name in ("window", "batch", "every", "buffer"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (2 if name == "window" else 1):
                raise ValueError(f"eagle online.{name} must be an integer >= {2 if name == 'window' else 1}, "
                                 f"got {v!r}")
        for name in ("lr", "noise", "w_cls", "max_share"):
            v = getattr(self, name)
            positive = name in ("lr", "max_share")
            if not isinstance(v, (int, float)) or v < 0 or (positive and v == 0):
                raise ValueError(f"eagle online.{name} must be a {'positive' if positive else 'non-negative'} "
                                 f"number, got {v!r}")


class OnlineDistiller:
    """Trains ``head`` (float weights; its frozen LM head may be int8 for drafting) on committed runs; see the
    module doc. The drafter calls :meth:`add` with each sequence's newly committed features, :meth:`maybe_train`
    once per drafting call and :meth:`finish` when a sequence ends."""

    def __init__(self, head: EagleHead, cfg: OnlineConfig | None = None) -> None:
        self.head, self.cfg = head, cfg or OnlineConfig()
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self._runs: dict[int, tuple[int, list[torch.Tensor], list[int]]] = {}   # seq -> (next pos, feats, tokens)
        self._windows: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=self.cfg.buffer)
        self._feature_scale: float | None = None
        self._calls = 0
        self._started = time.perf_counter()
        self.steps = 0                  # optimizer steps taken
        self.seconds = 0.0              # time spent in them
        self.last_parts: dict[str, float] = {}   # the last step's loss parts (reg, ce, top1 on the batch)

    def add(self, seq_id: int, start: int, feats: torch.Tensor, tokens: Sequence[int]) -> None:
        """Committed features ``feats`` [m, d] of positions ``start .. start + m - 1`` of one sequence and their
        tokens (x_start .. x_{start+m-1}). A gap restarts the sequence's run; every full window is kept."""
        pos, run_f, run_t = self._runs.get(seq_id, (start, [], []))
        if pos != start:
            run_f, run_t = [], []
        run_f += list(feats.detach().float().unbind(0))
        run_t += [int(t) for t in tokens]
        W = self.cfg.window
        while len(run_f) >= W:
            self._windows.append((torch.stack(run_f[:W]), torch.tensor(run_t[:W])))
            # the next window starts at the last pair's feature: pair W-1 (f_{W-1}, x_W) is then trained too
            run_f, run_t = run_f[W - 1:], run_t[W - 1:]
        self._runs[seq_id] = (start + len(feats), run_f, run_t)

    def finish(self, seq_id: int) -> None:
        self._runs.pop(seq_id, None)

    def maybe_train(self) -> bool:
        """One optimizer step on the most recent windows, every ``every`` calls and within ``max_share`` of the
        wall time; returns whether the head changed."""
        self._calls += 1
        cfg = self.cfg
        if self._calls % cfg.every or not self._windows:
            return False
        if self.seconds > cfg.max_share * (time.perf_counter() - self._started):
            return False
        t0 = time.perf_counter()
        batch = list(self._windows)[-cfg.batch:]
        feats = torch.stack([f for f, _ in batch]).to(self.head.lm_weight.device)
        toks = torch.stack([t for _, t in batch]).to(feats.device)
        if self._feature_scale is None:
            self._feature_scale = feats.abs().mean().item()
        valid = torch.ones(toks.shape, dtype=torch.bool, device=feats.device)
        head = self.head
        lm_int8, head.lm_int8 = head.lm_int8, None    # train through the float LM head rows (int8 has no grad)
        was_training = head.training
        try:
            head.train()
            with torch.enable_grad():
                loss, self.last_parts = distill_loss(head, feats.to(head.lm_weight.dtype), toks, valid,
                                                     noise=cfg.noise * self._feature_scale, w_cls=cfg.w_cls)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 0.5)
                self.opt.step()
        finally:
            head.lm_int8 = lm_int8
            head.train(was_training)
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        return True
