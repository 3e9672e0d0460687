"""Continuous batching under one token budget, stall-free (Sarathi-Serve), and the only writer of sequence state.

Each step every sequence is owed the tokens it knows (plus this step's draft) minus ``num_computed_tokens``.
Running sequences that are decoding (one token, or one plus a draft) are served first, then running prefills, then
waiting requests, each prefill taking a chunk of whatever budget is left, so a long prompt never pauses the decodes
around it. When the KV pool runs out, the youngest running sequence is preempted: its blocks are freed and it is
recomputed later from its tokens (nothing it produced is lost).

``schedule`` turns that into a frozen ``StepPlan`` and advances the counters as if every scheduled token will be
computed and every draft accepted; ``update(plan, result)`` then appends the sampled tokens (asking the
``StopChecker`` about each), rolls back the rejected draft nodes, keys newly full blocks for the prefix cache,
starts the siblings of an n > 1 request and frees what finished. Those two methods (and ``finish``) are the only
writers of ``num_computed_tokens``, ``num_placeholders``, ``token_ids`` and the block tables, as in vLLM v1's
``schedule`` / ``update_from_output``; so the scheduler can be tested without a model by fabricating results.

Advancing at schedule time is what lets the next step be planned before this one's tokens are read (an overlapped
step): a sequence whose sampled token is still on the device has a *placeholder*, and the next plan feeds that
token to the model on the device (``StepPlan.placeholders``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.engine.step import PLACEHOLDER, ScheduledSeq, StepPlan, StepResult
from leapdecode.engine.stop import StopChecker
from leapdecode.spec.tree import EMPTY, DraftTree


@dataclass
class UpdateOutput:
    touched: list[Sequence] = field(default_factory=list)      # sequences whose output changed
    finished: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 stops: StopChecker) -> None:
        self.bm, self.stops = block_manager, stops
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._forks: dict[int, list[Sequence]] = {}     # parent seq_id -> siblings waiting for its prompt
        self._kv_moves: list[tuple[int, int]] = []      # tree compactions owed to the cache, for the next plan
        self._sample_row: dict[int, int] = {}           # seq_id -> its bonus row in the latest plan
        self._step_id = 0

    # -- admission ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, siblings: list[Sequence] | tuple = ()) -> None:
        """Queue ``seq``; ``siblings`` (the other samples of an n > 1 request) start once its prompt is computed
        and share its full prompt blocks."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if siblings:
            self._forks[seq.seq_id] = list(siblings)

    def decoding(self) -> list[Sequence]:
        """Running sequences that may take a draft this step."""
        return [s for s in self.running if s.is_decoding]

    def draft_room(self, seq: Sequence) -> int:
        """Most draft tokens ``seq`` may verify now: its remaining budget less the bonus token. 0 for a
        Mirostat request (neither a drafter's nor a grammar's; ``schedule`` drops any proposal for one): the
        truncation at a draft position depends on the threshold mu after the tokens before it, that is on their
        acceptance."""
        return 0 if seq.params.mirostat else max(0, self.stops.room(seq) - 1)

    # -- planning ----------------------------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[int, DraftTree] | None = None) -> StepPlan:
        """Plan one step. ``drafts``: proposals for decoding sequences (seq_id -> tree); a draft the budget cuts
        is trimmed to a topological prefix."""
        drafts = drafts or {}
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int, DraftTree]] = []
        taken: set[int] = set()
        preempted: list[int] = []

        # 1. Running sequences: decodes (and verification) first, then unfinished prefills.
        for seq in sorted(self.running, key=lambda s: s.is_prefill):
            if seq.status != SequenceStatus.RUNNING:      # preempted earlier in this loop
                continue
            if budget == 0:
                break
            if seq.num_placeholders and self.stops.room(seq) <= 0:
                continue                                  # its last token is in flight: nothing more to compute
            draft = drafts.get(seq.seq_id, EMPTY) if seq.is_decoding and not seq.params.mirostat else EMPTY
            owed = seq.num_tokens + seq.num_placeholders + len(draft) - seq.num_computed_tokens
            if owed <= 0:
                continue
            n = min(owed, budget)
            final = seq.num_computed_tokens + min(n, owed - len(draft))     # draft nodes are not final
            while not self.bm.allocate(seq, seq.num_computed_tokens + n, final):
                victim = self._youngest_unscheduled(taken) or seq
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            if n < owed:                                  # the budget cut into the draft: verify fewer nodes
                draft = draft.prefix(max(0, len(draft) - (owed - n)))
            chunks.append((seq, n, draft))
            taken.add(seq.seq_id)
            budget -= n

        # 2. Waiting sequences, oldest first, only when nobody had to be preempted (the pool is not tight).
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_placeholders:                      # preempted with a token in flight: wait for it
                break
            # prompt logprobs and contrastive search need every prompt row computed: no prefix-cache adoption
            if (not seq.block_table and seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None
                    and not seq.params.contrastive):
                seq.num_computed_tokens = self.bm.match_prefix(seq)
                seq.num_cached_tokens = seq.num_computed_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                self.bm.free_seq(seq)                     # do not pin prefix-cache hits while waiting
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append((seq, n, EMPTY))
            budget -= n

        if not chunks:
            return StepPlan(self._step_id, (), self.bm.block_size)
        return self._freeze(chunks, preempted)

    def _freeze(self, chunks: list[tuple[Sequence, int, DraftTree]], preempted: list[int]) -> StepPlan:
        """Snapshot the chunks into a plan (numbering logits and sample rows once), then advance the counters as
        if all of it will be computed and accepted."""
        planned, placeholders = [], []
        offset = logits = samples = 0
        for seq, n, draft in chunks:
            start, d = seq.num_computed_tokens, len(draft)
            known = n - d
            ids = seq.token_ids[start:start + known]
            if len(ids) < known:                          # the tail is a token still on the device
                assert known - len(ids) == 1 and seq.num_placeholders == 1, seq
                placeholders.append((offset + len(ids), self._sample_row[seq.seq_id]))
                ids.append(PLACEHOLDER)
            sampled = 1 + d if start + known == len(seq.token_ids) + seq.num_placeholders else 0
            plp = (seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
                   and len(seq.prompt_logprobs) < seq.num_prompt_tokens)
            n_logits = n if plp else sampled
            sealing = self.bm.seal(seq, start + known)     # windowed KV: the blocks this step lets seal
            planned.append(ScheduledSeq(seq.seq_id, start, tuple(ids) + draft.tokens if d else tuple(ids),
                                        tuple(seq.block_table), draft, sampled > 0, plp, logits, n_logits, samples,
                                        self.bm.open_window(seq), sealing))
            offset += n
            logits += n_logits
            samples += sampled
        plan = StepPlan(self._step_id, tuple(planned), self.bm.block_size, logits, samples, tuple(self._kv_moves),
                        tuple(placeholders), tuple(preempted), self.bm.take_late_seals(),
                        self.bm.take_deferred_seals())
        self._step_id += 1
        self._kv_moves = []
        self._sample_row = {}
        for (seq, n, _), s in zip(chunks, planned):
            seq.num_computed_tokens += n
            if s.samples:
                seq.num_placeholders += 1
                self._sample_row[seq.seq_id] = s.sample_start
        return plan

    def _youngest_unscheduled(self, taken: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.status == SequenceStatus.RUNNING and seq.seq_id not in taken:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and start over later; the sequence keeps its tokens, so recompute resumes exactly."""
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- results -----------------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, seqs: Mapping[int, Sequence]) -> UpdateOutput:
        """Apply a step's result: append tokens up to the first stop, roll back rejected drafts, key full blocks,
        fork siblings, free what finished. ``seqs`` maps the plan's seq_ids to their sequences."""
        out = UpdateOutput()
        for c in plan.seqs:
            seq = seqs.get(c.seq_id)
            if seq is None or seq.is_finished:            # aborted (or ended) while the step was in flight
                continue
            error = result.errors.get(c.seq_id)
            if error is None:
                try:
                    stop = self._apply(c, seq, result, out)
                except Exception as e:                    # noqa: BLE001 - a fault of this request alone
                    error = f"{type(e).__name__}: {e}"
            if error is not None:
                stop = ("error", error)
                if seq not in out.touched:
                    out.touched.append(seq)
            if stop is not None:
                self.finish(seq, *stop)
                out.finished.append(seq)
        return out

    def _apply(self, c: ScheduledSeq, seq: Sequence, result: StepResult, out: UpdateOutput):
        """One sequence's share of a result; returns (finish_reason, stop_reason) if it ended."""
        entries = result.prompt_logprobs.get(c.seq_id)
        if entries:
            first = c.start + 1                           # entry j is for the token at position start + 1 + j
            seq.prompt_logprobs.extend(entries[len(seq.prompt_logprobs) - first:])
        r = result.seqs.get(c.seq_id)
        if r is None:                                     # a prefill chunk that does not reach the end
            if seq.status == SequenceStatus.RUNNING:
                self.bm.commit(seq, c.start + c.num_new_tokens)
            if entries:
                out.touched.append(seq)
            return None
        seq.num_placeholders -= 1
        if c.draft and seq.status == SequenceStatus.RUNNING:
            seq.num_computed_tokens -= len(c.draft) - len(r.accepted)
            self._compact_tree(c, r)
        if not r.tokens:
            # No token chosen this step (a decoding strategy that decides later: beam search waiting for its
            # whole group, contrastive search's first candidates): the last known token is computed again next
            # step, which gives its row again (its KV slot is rewritten with the same values).
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
                self.bm.commit(seq, seq.num_computed_tokens)
            return None
        self._fork(seq)
        out.touched.append(seq)
        if r.mirostat_mu is not None:
            seq.mirostat_mu = r.mirostat_mu
        stop = self._append(seq, r)
        if seq.status == SequenceStatus.RUNNING:
            self.bm.commit(seq, c.start + c.num_committed + len(r.accepted))
        return stop

    def _append(self, seq: Sequence, r) -> tuple[str, int | str | None] | None:
        """Append the verified tokens one by one, stopping at the first that ends the sequence."""
        for i, token in enumerate(r.tokens):
            seq.token_ids.append(token)
            if r.logprobs is not None and seq.logprobs is not None and r.logprobs[i] is not None:
                chosen, top = r.logprobs[i]
                entry = dict(top[:seq.params.logprobs])
                entry[token] = chosen
                seq.logprobs.append(entry)
                seq.cumulative_logprob += chosen
            stop = self.stops.check(seq, token)
            if stop is not None:
                return stop
        return None

    def _compact_tree(self, c: ScheduledSeq, r) -> None:
        """An accepted tree branch is not where its KV was written: move it into place before the next forward."""
        if c.draft.is_chain:                              # a chain's accepted nodes are already in place
            return
        accepted = list(r.accepted)
        if accepted == list(range(len(accepted))):
            return
        base, bs = c.start + c.num_committed, self.bm.block_size

        def slot(i: int) -> int:
            return self.bm.kv_slot(c.block_table[i // bs], i % bs)

        self._kv_moves += [(slot(base + i), slot(base + j)) for j, i in enumerate(accepted)]

    def _fork(self, parent: Sequence) -> None:
        """n > 1: siblings adopt the parent's full prompt blocks and compute only the prompt's tail."""
        siblings = self._forks.pop(parent.seq_id, None)
        if not siblings:
            return
        shared = (parent.num_prompt_tokens - 1) // self.bm.block_size
        for child in siblings:
            child.num_computed_tokens = self.bm.share_prefix(parent, child, shared)
            self.waiting.appendleft(child)

    def fork(self, parent: Sequence, token: int, index: int) -> Sequence:
        """Beam search: a new running sequence that is ``parent`` followed by ``token``, called between a step and
        its ``update`` (the parent's KV is computed for all its tokens, its own next token still pending). The
        child shares the parent's full blocks (reference counts) and gets its own copy of the partial last block
        (copy-on-write: slot copies applied before the next forward); if the pool has no block to spare, it shares
        the full blocks only and computes the tail again."""
        computed = parent.num_computed_tokens
        assert computed == parent.num_tokens and parent.status == SequenceStatus.RUNNING, parent
        child = Sequence(parent.request_id, index, parent.token_ids[:parent.num_prompt_tokens], parent.params)
        child.token_ids = parent.token_ids + [token]
        bs = self.bm.block_size
        full, tail = divmod(computed, bs)
        child.num_computed_tokens = self.bm.share_prefix(parent, child, full)
        if tail and self.bm.allocate(child, computed):
            src, dst = self.bm.kv_slot(parent.block_table[full], 0), self.bm.kv_slot(child.block_table[full], 0)
            self._kv_moves += [(src + i, dst + i) for i in range(tail)]
            child.num_computed_tokens = computed
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return child

    def finish(self, seq: Sequence, reason: str | None = None, stop_reason: int | str | None = None) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks; ``reason`` (with its
        ``stop_reason``) is the finish reason it reports, when not already set."""
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._forks.pop(seq.seq_id, None)
        for siblings in self._forks.values():
            if seq in siblings:
                siblings.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free_seq(seq, keep_recent=True)
