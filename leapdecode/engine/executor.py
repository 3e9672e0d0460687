"""The executor boundary: the engine hands a plan to "something that runs it" and gets logits rows back.

Everything that crosses this boundary is plain data: a ``StepPlan`` in (token ids, positions implied by token
ranges and draft trees, block tables, KV moves, placeholder rows), a ``ForwardOutput`` out (tensors). Today the
executor is the in-process ``ModelRunner``; a worker process, a tensor-parallel group (rank 0 returning the
logits) or a remote instance can implement the same three calls without the scheduler noticing. Sampling and
verification stay with the engine (``sampling/verifier.py``), which holds the engine's random generator (seeded
requests draw from keys of (seed, sample index, position), see sampling/sampler.py).
"""
from __future__ import annotations

from typing import Protocol

import torch

from leapdecode.engine.input_batch import ForwardBatch
from leapdecode.engine.model_runner import ForwardOutput
from leapdecode.engine.step import StepPlan


class Executor(Protocol):
    num_blocks: int                      # KV blocks the executor's cache holds (the block manager's pool size)
    num_window_blocks: int               # full-precision blocks for open blocks (int8/int4 KV caches), else 0

    def kv_cache_info(self) -> dict:
        """The KV cache's format, block count and sizes (``LLM.kv_cache_info``)."""

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Write the plan's inputs into the executor's buffers (may run while the previous step executes)."""

    def execute(self, plan: StepPlan, batch: ForwardBatch | None = None, last_sampled: torch.Tensor | None = None,
                capture: tuple[int, ...] = ()) -> ForwardOutput:
        """Apply the plan's KV moves, fill its placeholders from ``last_sampled``, run one forward, return the
        logits of its logits rows (and the hidden states asked for)."""
