"""The executor boundary: the engine hands a plan to "something that runs it" and gets logits rows back.

Everything that crosses this boundary is plain data: a ``StepPlan`` in (token ids, positions implied by token
ranges and draft trees, block tables, KV moves, placeholder rows), a ``ForwardOutput`` out (tensors). The
executor is the in-process ``ModelRunner``, or a tensor-parallel group (``engine/tp_executor.py``: rank 0 returns
the logits); a worker process or a remote instance can implement the same calls without the scheduler noticing.
``build_executor`` picks the implementation from the config. Sampling and verification stay with the engine
(``sampling/verifier.py``), which holds the engine's random generator (seeded requests draw from keys of (seed,
sample index, position), see sampling/sampler.py).
"""
from __future__ import annotations

from typing import Protocol

import torch

from leapdecode.attention.kv_cache import KVLayout
from leapdecode.config import EngineConfig
from leapdecode.engine.input_batch import ForwardBatch
from leapdecode.engine.model_runner import ForwardOutput, ModelRunner
from leapdecode.engine.step import StepPlan
from leapdecode.model.config import ModelConfig


class Executor(Protocol):
    num_blocks: int                      # KV blocks the executor's cache holds (the block manager's pool size)
    num_window_blocks: int               # full-precision blocks of a quantized cache's open window (0: none)
    defer_seals: bool                    # a windowed cache's blocks seal after the forward of the step filling them
    kv_layout: KVLayout                  # the KV cache's format (what a block holds)

    def kv_cache_info(self) -> dict:
        """The KV cache's format, block count and sizes (``LLM.kv_cache_info``)."""

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Write the plan's inputs into the executor's buffers (may run while the previous step executes)."""

    def execute(self, plan: StepPlan, batch: ForwardBatch | None = None, last_sampled: torch.Tensor | None = None,
                capture: tuple[int, ...] = (), all_rows: bool = False) -> ForwardOutput:
        """Apply the plan's KV moves, fill its placeholders from ``last_sampled``, run one forward, return the
        logits of its logits rows (and the hidden states asked for)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states the engine holds (DoLa's early exits)."""

    def read_kv_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Copies of pool blocks on the CPU, every plane of the format (``KVCache.read_blocks``): a KV export."""

    def write_kv_blocks(self, blocks: list[int], data: list[tuple[torch.Tensor, ...]]) -> None:
        """Overwrite pool blocks with blocks read by ``read_kv_blocks`` of an executor of the same layout."""

    def seal_kv_blocks(self, seals: tuple[tuple[int, int], ...]) -> None:
        """Apply late seals (pool block, window block) now, outside a step: before an export reads the blocks."""

    def close(self) -> None:
        """Release what the executor holds outside this process (worker processes); idempotent."""


def build_executor(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, max_model_len: int) -> Executor:
    """The in-process runner, or a tensor-parallel group when ``cfg.tensor_parallel_size > 1``."""
    if cfg.tensor_parallel_size > 1:
        from leapdecode.engine.tp_executor import TensorParallelExecutor
        return TensorParallelExecutor(cfg, model_cfg, dtype, max_model_len)
    return ModelRunner(cfg, model_cfg, dtype, max_model_len)
