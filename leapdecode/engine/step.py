"""The step as a value: what the scheduler decided (``StepPlan``) and what sampling found (``StepResult``).

Both are frozen plain data (ints, tuples, token trees), so they can be logged, compared in tests, pickled to a
worker process or a tensor-parallel group, and replayed. The data flows one way:

    Scheduler.schedule(drafts) -> StepPlan -> Executor.execute(plan) -> logits rows
        -> Verifier.verify(plan, logits) -> StepResult -> Scheduler.update(plan, result)

The row layout is computed once, here, when the plan is built: sequence i owns logits rows
``[logits_start, logits_start + num_logits)`` and, if it samples, sample rows ``[sample_start, sample_start + 1 +
len(draft))`` (row 0: after its last committed token, row 1 + j: after draft node j). Grammar bitmasks use the
sample-row numbering.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.spec.tree import EMPTY, DraftTree

PLACEHOLDER = -1    # a token id the host does not know yet: filled on the device from the previous step's sample


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq_id: int
    start: int                        # index of the first token this step computes
    token_ids: tuple[int, ...]        # the tokens it computes: known tokens, then the draft's nodes
    block_table: tuple[int, ...]      # covers every token computed this step
    draft: DraftTree = EMPTY          # verified this step; a draft only rides on a chunk that samples
    samples: bool = False             # the chunk reaches the end of the known tokens: the next one is sampled
    prompt_logprobs: bool = False     # logits for every row of the chunk (prompt logprobs)
    logits_start: int = 0
    num_logits: int = 0
    sample_start: int = 0
    kv_window: tuple[int, ...] = ()   # windowed KV: window blocks of the table's trailing open blocks
    kv_sealing: tuple[int, ...] = ()  # ... and of the blocks just before them, which this step seals (-1: none)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_committed(self) -> int:
        """Tokens of the chunk that are not draft nodes."""
        return len(self.token_ids) - len(self.draft)

    @property
    def num_samples(self) -> int:
        return 1 + len(self.draft) if self.samples else 0

    @property
    def sample_logits_rows(self) -> range:
        """The logits rows this sequence samples from (the chunk's last 1 + len(draft) rows)."""
        end = self.logits_start + self.num_logits
        return range(end - self.num_samples, end)

    def positions(self) -> list[int]:
        """Positions of the chunk's tokens: consecutive, except that a draft node sits at last + depth."""
        committed = list(range(self.start, self.start + self.num_committed))
        if not self.draft:
            return committed
        return committed + self.draft.positions(self.start + self.num_committed - 1)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    block_size: int
    num_logits: int = 0
    num_samples: int = 0
    kv_moves: tuple[tuple[int, int], ...] = ()      # (src slot, dst slot): applied before the forward
    placeholders: tuple[tuple[int, int], ...] = ()  # (token index in the flat batch, sample row of the last step)
    preempted: tuple[int, ...] = ()
    kv_seals: tuple[tuple[int, int], ...] = ()      # (pool block, window block): finished sequences' recent blocks,
                                                    # quantized after the moves, before the forward (windowed KV)
    kv_seals_after: tuple[tuple[int, int], ...] = ()  # (pool block, window block): blocks the step fills, quantized
                                                      # from the window after the forward (deferred seals)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def num_drafted(self) -> int:
        return sum(len(s.draft) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def sample_logits_rows(self) -> list[int]:
        return [r for s in self.seqs for r in s.sample_logits_rows]


def lay_out(step_id: int, block_size: int, chunks: list[ScheduledSeq], **extra) -> StepPlan:
    """Number the logits and sample rows of ``chunks`` (in order) and freeze them into a plan."""
    seqs, logits, samples = [], 0, 0
    for c in chunks:
        n_logits = c.num_new_tokens if c.prompt_logprobs else c.num_samples
        seqs.append(ScheduledSeq(c.seq_id, c.start, c.token_ids, c.block_table, c.draft, c.samples,
                                 c.prompt_logprobs, logits, n_logits, samples, c.kv_window, c.kv_sealing))
        logits += n_logits
        samples += c.num_samples
    return StepPlan(step_id, tuple(seqs), block_size, logits, samples, **extra)


@dataclass(frozen=True, slots=True)
class SeqResult:
    """One sequence's outcome: accepted draft nodes (root first), the tokens to append (accepted + bonus), and
    per appended token its logprobs (chosen, top-N) and the target's top-k (for drafters that learn from it);
    for a Mirostat request, its threshold mu after this step's token (the scheduler stores it)."""
    seq_id: int
    accepted: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple | None = None
    topk: tuple | None = None
    mirostat_mu: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    seqs: dict[int, SeqResult] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)   # seq_id -> entries for prompt positions
    errors: dict[int, str] = field(default_factory=dict)   # seq_id -> why sampling failed for that sequence alone
