"""One sample being generated: its tokens, how many have KV in the cache, and its blocks.

The engine's one scheduling rule reads two numbers from here: ``num_computed_tokens`` (tokens whose KV is in the
cache, or is being written by a step in flight) and the tokens the sequence knows (``num_tokens`` plus
``num_placeholders``, tokens sampled on the device whose value the host has not read yet). The scheduler hands out
the difference, plus this step's draft. Only the scheduler writes these fields (``Scheduler.schedule`` and
``Scheduler.update``); everything else reads them. A step's draft never lives here: it travels in the step plan.
"""
from __future__ import annotations

import itertools
from enum import Enum, auto

from leapdecode.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_placeholders = 0            # sampled by a step in flight, not yet appended (overlapped steps)
        self.num_cached_tokens = 0           # prompt tokens found in the prefix cache at first schedule
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the leading full, computed blocks
        self.num_kv_final = 0                # leading tokens whose KV is final (the block manager's last commit)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        # Mirostat's surprise threshold for the next token (sampling/mirostat.py): 2 * tau at the start
        self.mirostat_mu: float | None = 2.0 * params.mirostat_tau if params.mirostat else None

    # -- token counts -----------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or everything after a preemption)."""
        return self.num_computed_tokens < self.num_tokens + self.num_placeholders - 1

    @property
    def is_decoding(self) -> bool:
        """Needs exactly one more token computed, the last known one: the moment a draft can ride along."""
        return (self.status == SequenceStatus.RUNNING and self.num_placeholders == 0
                and self.num_computed_tokens == self.num_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
