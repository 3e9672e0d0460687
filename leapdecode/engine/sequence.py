"""One sample being generated: its tokens, how many have KV in the cache, its draft, and its blocks.

The engine's one scheduling rule reads two numbers from here: ``num_computed_tokens`` (tokens whose KV is in the
cache) and ``num_tokens_with_spec`` (prompt + output + draft). The scheduler hands out the difference.
"""
from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from leapdecode.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prompt tokens found in the prefix cache at first schedule
        self.draft_tokens: list[int] = []
        self.draft_parents: list[int] | None = None   # token tree: parent index per draft token (-1: last token)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the leading full, computed blocks
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""                       # detokenized output, stop strings cut
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

    # -- token counts -----------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.draft_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already knows (prompt, or everything after a preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        n = len(self.token_ids)
        if end <= n:
            return self.token_ids[start:end]
        return self.token_ids[start:] + self.draft_tokens[max(start - n, 0):end - n]

    def set_draft(self, tokens: list[int], parents: list[int] | None = None) -> None:
        self.draft_tokens = list(tokens)
        self.draft_parents = list(parents) if parents is not None else None

    def trim_draft(self, keep: int) -> None:
        """Keep the first ``keep`` draft tokens (a topological prefix of a tree is still a tree)."""
        self.draft_tokens = self.draft_tokens[:keep]
        if self.draft_parents is not None:
            self.draft_parents = self.draft_parents[:keep]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, draft={len(self.draft_tokens)}, {self.status.name})")
