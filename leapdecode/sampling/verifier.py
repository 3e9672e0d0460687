"""Logits rows in, a ``StepResult`` out: every verified position is sampled exactly as plain decoding would sample
it (penalties, grammar mask, temperature, top-k/p, seeds), then each draft is walked (sample-then-match, see
``DraftTree.walk`` and sampling/rejection.py). A sequence with no draft has one row, and that is plain decoding.

The plan already says which logits row is which sequence and draft node (``ScheduledSeq.sample_start``), so this
module reads the layout and never derives it. It runs wherever the forward ran last (the engine thread, or the
worker thread of an overlapped step) and touches no sequence state: it only reads parameters and histories.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Mapping

import torch

from leapdecode.engine.step import ScheduledSeq, SeqResult, StepPlan, StepResult, lay_out
from leapdecode.sampling.sampler import Row, SamplingBatch, compute_logprobs

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence


class Verifier:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: set[int], seed: int,
                 structured: Any, topk: int = 0) -> None:
        self.vocab_size, self.device, self.eos_token_ids = vocab_size, device, eos_token_ids
        self.generator = torch.Generator(device).manual_seed(seed)
        self.structured = structured     # the grammar's part of sampling: mask rows and ASAp (engine/structured_output.py)
        self.topk = topk                 # > 0: report the target's top-k at each used row (drafters learn from it)

    def batch(self, plan: StepPlan, seqs: Mapping[int, "Sequence"]) -> SamplingBatch | None:
        """The sampling rows of a plan, in its order: per sampling sequence, its last token then each draft node."""
        rows: list[Row] = []
        for c in plan.seqs:
            if c.samples:
                seq = seqs[c.seq_id]
                rows.append(Row(seq, ()))
                if c.draft:
                    rows += [Row(seq, path) for path in c.draft.node_paths()]
        return SamplingBatch(rows, self.vocab_size, self.device, self.eos_token_ids) if rows else None

    def verify(self, plan: StepPlan, logits: torch.Tensor, batch: SamplingBatch | None, masks: Any,
               seqs: Mapping[int, "Sequence"]) -> tuple[StepResult, torch.Tensor | None]:
        """-> (the step's result, the sampled tokens per sample row on the device).

        If sampling the batch raises, each sequence is sampled alone so the fault stays with the request that
        causes it (``StepResult.errors``); the others get their tokens as usual."""
        try:
            return self._verify(plan, logits, batch, masks, seqs)
        except Exception:
            if sum(c.samples or c.prompt_logprobs for c in plan.seqs) <= 1:
                raise
            return self._isolate(plan, logits, masks, seqs), None

    def _isolate(self, plan: StepPlan, logits: torch.Tensor, masks: Any, seqs: Mapping[int, "Sequence"]) -> StepResult:
        out = StepResult(plan.step_id)
        for c in plan.seqs:
            if not (c.samples or c.prompt_logprobs):
                continue
            alone = lay_out(plan.step_id, plan.block_size, [c])
            try:
                r, _ = self._verify(alone, logits[c.logits_start:c.logits_start + c.num_logits],
                                    self.batch(alone, seqs), _rows_of(masks, c), seqs)
            except Exception as e:          # noqa: BLE001 - the request ends with this error; the others go on
                out.errors[c.seq_id] = f"{type(e).__name__}: {e}"
                continue
            out.seqs.update(r.seqs)
            out.prompt_logprobs.update(r.prompt_logprobs)
        return out

    def _verify(self, plan: StepPlan, logits: torch.Tensor, batch: SamplingBatch | None, masks: Any,
                seqs: Mapping[int, "Sequence"]) -> tuple[StepResult, torch.Tensor | None]:
        prompt = self._prompt_logprobs(plan, logits, seqs)
        if batch is None:
            return StepResult(plan.step_id, {}, prompt), None
        whole = plan.num_samples == plan.num_logits     # no prompt-logprob rows: the sample rows are all rows
        raw = logits if whole else logits[torch.tensor(plan.sample_logits_rows(), device=logits.device)]
        probs = batch.process(self.structured.apply(raw, masks))
        if not batch.all_greedy:
            probs = self.structured.align(batch.rows, probs, lambda: batch.process(raw), masks)
        sampled_t = batch.sample(probs, self.generator)
        sampled = sampled_t.tolist()                    # the step's one device -> host synchronisation
        lps = None
        if batch.max_logprobs is not None:
            chosen, top = compute_logprobs(raw, sampled_t, batch.max_logprobs)
            lps = list(zip(chosen, top))
        topk = raw.topk(self.topk, dim=-1).indices.tolist() if self.topk else None
        results: dict[int, SeqResult] = {}
        for c in plan.seqs:
            if not c.samples:
                continue
            r0 = c.sample_start
            if c.draft:
                path, bonus = c.draft.walk(sampled[r0:r0 + c.num_samples])
            else:                                       # plain decoding: the draw is the token
                path, bonus = [], sampled[r0]
            used = [r0] + [r0 + 1 + i for i in path]
            results[c.seq_id] = SeqResult(
                c.seq_id, tuple(path), tuple(c.draft.tokens[i] for i in path) + (bonus,),
                logprobs=tuple(lps[r] for r in used) if lps else None,
                topk=tuple(topk[r] for r in used) if topk else None)
        return StepResult(plan.step_id, results, prompt), sampled_t

    @staticmethod
    def _prompt_logprobs(plan: StepPlan, logits: torch.Tensor, seqs: Mapping[int, "Sequence"]) -> dict:
        """Row j of a prompt chunk predicts the token at position start + j + 1; keep those that are prompt tokens."""
        out = {}
        for c in plan.seqs:
            if not c.prompt_logprobs:
                continue
            seq = seqs[c.seq_id]
            n = min(c.num_new_tokens, seq.num_prompt_tokens - 1 - c.start)
            if n <= 0:
                continue
            targets = torch.tensor(seq.token_ids[c.start + 1:c.start + 1 + n], device=logits.device)
            chosen, top = compute_logprobs(logits[c.logits_start:c.logits_start + n], targets,
                                           seq.params.prompt_logprobs)
            entries = []
            for t, lp, tp in zip(targets.tolist(), chosen, top):
                entry = dict(tp)
                entry[t] = lp
                entries.append(entry)
            out[c.seq_id] = tuple(entries)
        return out


def _rows_of(masks: Future | None, c: ScheduledSeq) -> Future | None:
    """The grammar mask rows of one sequence, renumbered as if it were sampled alone."""
    if masks is None:
        return None
    bitmask, rows = masks.result()
    keep = [i for i, r in enumerate(rows) if c.sample_start <= r < c.sample_start + c.num_samples]
    if not keep:
        return None
    alone: Future = Future()
    alone.set_result((bitmask[keep], [rows[i] - c.sample_start for i in keep]))
    return alone
