"""Continuous batching under one token budget, stall-free (Sarathi-Serve).

Each step every sequence is owed ``num_tokens_with_spec - num_computed_tokens`` tokens. Running sequences that are
decoding (one token, or one plus a draft) are served first, then running prefills, then waiting requests, each
prefill taking a chunk of whatever budget is left, so a long prompt never pauses the decodes around it. When the
KV pool runs out, the youngest running sequence is preempted: its blocks are freed and it is recomputed later from
its tokens (nothing it produced is lost).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int        # tokens this step computes, from seq.num_computed_tokens on

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the known tokens, so the model must produce the next one?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens_with_spec


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.bm = block_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        taken: set[int] = set()
        preempted: list[Sequence] = []

        # 1. Running sequences: decodes (and verification) first, then unfinished prefills.
        for seq in sorted(self.running, key=lambda s: s.is_prefill):
            if seq.status != SequenceStatus.RUNNING:      # preempted earlier in this loop
                continue
            if budget == 0:
                break
            owed = seq.num_tokens_with_spec - seq.num_computed_tokens
            n = min(owed, budget)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self._youngest_unscheduled(taken) or seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            if n < owed and not seq.is_prefill:           # budget cut into the draft: verify fewer drafts
                seq.trim_draft(seq.num_computed_tokens + n - seq.num_tokens)
            scheduled.append(ScheduledSeq(seq, n))
            taken.add(seq.seq_id)
            budget -= n

        # 2. Waiting sequences, oldest first, only when nobody had to be preempted (the pool is not tight).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens_with_spec - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                self.bm.free_seq(seq)                     # do not pin prefix-cache hits while waiting
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _youngest_unscheduled(self, taken: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.status == SequenceStatus.RUNNING and seq.seq_id not in taken:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and start over later; the sequence keeps its tokens, so recompute resumes exactly."""
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.set_draft([])
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free_seq(seq)
