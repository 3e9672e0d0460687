"""Logits rows in, a ``StepResult`` out: every verified position is sampled exactly as plain decoding would sample
it (penalties, grammar mask, temperature, top-k/p, seeds), then each draft is walked (sample-then-match, see
``DraftTree.walk`` and sampling/rejection.py); a chain drawn from a model's distribution q is verified with
min(1, p/q) and the residual instead, and a tree drawn from q (siblings without replacement) by recursive rejection
over siblings (sampling/rejection.py), unless its request is greedy. A sequence with no draft has one row, and that
is plain decoding.

The plan already says which logits row is which sequence and draft node (``ScheduledSeq.sample_start``), so this
module reads the layout and never derives it. It runs wherever the forward ran last (the engine thread, or the
worker thread of an overlapped step) and touches no sequence state: it only reads parameters and histories (a
Mirostat request's next threshold mu goes back in its ``SeqResult`` for the scheduler to store).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Collection, Mapping

import torch

from leapdecode.engine.step import ScheduledSeq, SeqResult, StepPlan, StepResult, lay_out
from leapdecode.sampling.rejection import ACCEPT_SALT, speculative_chains, verify_tree_with_probs
from leapdecode.sampling.sampler import (Row, SamplingBatch, _position, argmax_rows, compute_logprobs,
                                         inverse_cdf_sample, keyed_uniforms, seeded_uniform)

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence
    from leapdecode.sampling.dola import Premature


class Verifier:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: set[int], seed: int,
                 structured: Any, topk: int = 0) -> None:
        self.vocab_size, self.device, self.eos_token_ids = vocab_size, device, eos_token_ids
        self.generator = torch.Generator(device).manual_seed(seed)
        self.structured = structured     # the grammar's part of sampling: mask rows and ASAp (engine/structured_output.py)
        self.topk = topk                 # > 0: report the target's top-k at each used row (drafters learn from it)
        self.num_prob_chains = 0         # drafts verified with min(1, p/q) (drafts that carry their distributions)
        self.num_prob_trees = 0          # ... trees, by recursive rejection over siblings

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
               seqs: Mapping[int, "Sequence"], draft_probs: Mapping[int, tuple] | None = None,
               premature: "Premature | None" = None, want_topk: bool = True) -> tuple[StepResult, torch.Tensor | None]:
        """-> (the step's result, the sampled tokens per sample row on the device).

        ``want_topk``: report the target's top-k at each used row this step, if the verifier was built to (False: a
        step whose drafter learns nothing from it; a set of sequence ids: those sequences' rows only).

        ``draft_probs``: seq_id -> (the drafter's chain, its q rows) for drafts drawn from a model's distribution
        (``Speculator.take_probs``); such a chain, when the plan kept a prefix of it, is verified with
        min(1, p/q) and the residual (sampling/rejection.py) unless its request is greedy.

        ``premature``: the early exits of DoLa rows (sampling/dola.py); those rows sample from the layer contrast
        instead of the logits (draft rows too), and report the model's own logprobs.

        If sampling the batch raises, each sequence is sampled alone so the fault stays with the request that
        causes it (``StepResult.errors``); the others get their tokens as usual."""
        try:
            return self._verify(plan, logits, batch, masks, seqs, draft_probs, premature, want_topk)
        except Exception:
            if sum(c.samples or c.prompt_logprobs for c in plan.seqs) <= 1:
                raise
            return self._isolate(plan, logits, masks, seqs, draft_probs, premature, want_topk), None

    def _isolate(self, plan: StepPlan, logits: torch.Tensor, masks: Any, seqs: Mapping[int, "Sequence"],
                 draft_probs: Mapping[int, tuple] | None = None, premature: "Premature | None" = None,
                 want_topk: bool = True) -> StepResult:
        out = StepResult(plan.step_id)
        for c in plan.seqs:
            if not (c.samples or c.prompt_logprobs):
                continue
            alone = lay_out(plan.step_id, plan.block_size, [c])
            try:
                r, _ = self._verify(alone, logits[c.logits_start:c.logits_start + c.num_logits],
                                    self.batch(alone, seqs), _rows_of(masks, c), seqs, draft_probs,
                                    premature.of(c) if premature is not None else None, want_topk)
            except Exception as e:          # noqa: BLE001 - the request ends with this error; the others go on
                out.errors[c.seq_id] = f"{type(e).__name__}: {e}"
                continue
            out.seqs.update(r.seqs)
            out.prompt_logprobs.update(r.prompt_logprobs)
        return out

    def _verify(self, plan: StepPlan, logits: torch.Tensor, batch: SamplingBatch | None, masks: Any,
                seqs: Mapping[int, "Sequence"], draft_probs: Mapping[int, tuple] | None = None,
                premature: "Premature | None" = None, want_topk: bool = True
                ) -> tuple[StepResult, torch.Tensor | None]:
        prompt = self._prompt_logprobs(plan, logits, seqs)
        if batch is None:
            return StepResult(plan.step_id, {}, prompt), None
        whole = plan.num_samples == plan.num_logits     # no prompt-logprob rows: the sample rows are all rows
        raw = logits if whole else logits[torch.tensor(plan.sample_logits_rows(), device=logits.device)]
        scores = raw if premature is None else premature.apply(raw, self.structured.apply(raw, masks))
        probs = batch.process(self.structured.apply(scores, masks))
        if not batch.all_greedy:
            probs = self.structured.align(batch.rows, probs, lambda: batch.process(scores), masks)
        if batch.all_greedy:
            sampled_t = argmax_rows(probs)
        else:
            u = batch.uniforms(probs.shape[0], self.generator)
            sampled_t = inverse_cdf_sample(probs, u)
            chains, trees = _drafts_with_probs(plan, seqs, draft_probs) if draft_probs else ([], [])
            if chains:
                self.num_prob_chains += len(chains)
                sampled_t, _ = speculative_chains(probs, sampled_t, u, chains,
                                                  self._accept_uniforms(batch, chains, probs.device))
            if trees:
                self.num_prob_trees += len(trees)
                sampled_t = self._verify_trees(probs, sampled_t, u, trees, batch)
        sampled = sampled_t.tolist()                    # the step's one device -> host synchronisation
        mu: dict[int, float] = {}                       # first sample row -> Mirostat's next mu (no drafts there)
        if batch.mirostat is not None:
            mu = dict(zip(batch.mirostat.rows, batch.mirostat.next_mu(probs, sampled_t)))
        lps = None
        if batch.max_logprobs is not None:
            chosen, top = compute_logprobs(raw, sampled_t, batch.max_logprobs)
            lps = list(zip(chosen, top))
        topk = self._topk(plan, raw, want_topk) if self.topk and want_topk else None
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
                topk=tuple(topk[r] for r in used) if topk and r0 in topk else None, mirostat_mu=mu.get(r0))
        return StepResult(plan.step_id, results, prompt), sampled_t

    def _topk(self, plan: StepPlan, raw: torch.Tensor, want: bool | Collection[int]) -> dict[int, list[int]]:
        """Sample row -> the target's top-k token ids there: every row, or the rows of the sequences in ``want``."""
        if want is True:
            return dict(enumerate(raw.topk(self.topk, dim=-1).indices.tolist()))
        rows = [r for c in plan.seqs if c.samples and c.seq_id in want
                for r in range(c.sample_start, c.sample_start + c.num_samples)]
        if not rows:
            return {}
        picked = raw[torch.tensor(rows, device=raw.device)] if len(rows) < raw.shape[0] else raw
        return dict(zip(rows, picked.topk(self.topk, dim=-1).indices.tolist()))

    def _verify_trees(self, probs: torch.Tensor, sampled_t: torch.Tensor, u: torch.Tensor, trees: list,
                      batch: SamplingBatch) -> torch.Tensor:
        """Token trees drawn from q (siblings without replacement): recursive rejection per sequence, written
        back as the emitted token of each used row so that ``DraftTree.walk`` finds the same branch."""
        emitted = sampled_t.clone()
        for r0, tree, q in trees:
            n = len(tree)
            ua = torch.rand(n, dtype=torch.float64, generator=self.generator, device=probs.device)
            seq = batch.rows[r0].seq
            if seq.params.seed is not None:
                ua = torch.tensor([seeded_uniform(seq.params.seed ^ ACCEPT_SALT ^ ((i + 1) * 0x9E3779B1), seq.index,
                                                  _position(batch.rows[r0 + 1 + tree.parent(i)]))
                                   for i in range(n)], dtype=torch.float64, device=probs.device)
            path, bonus = verify_tree_with_probs(tree, probs[r0:r0 + 1 + n], q, ua, u[r0:r0 + 1 + n])
            parent = -1
            for node in path:
                emitted[r0 + 1 + parent] = tree.tokens[node]
                parent = node
            emitted[r0 + 1 + parent] = bonus
        return emitted

    def _accept_uniforms(self, batch: SamplingBatch, chains: list, device: torch.device) -> torch.Tensor:
        """One uniform per draft node of ``chains``: a seeded request's keyed by (seed, sample index, position)
        under the acceptance salt, the others from the engine's generator."""
        seeded, i = [], 0
        for r0, x, _ in chains:
            row = batch.rows[r0]
            seed = row.seq.params.seed
            if seed is not None:
                seeded += [(i + j, seeded_uniform(seed ^ ACCEPT_SALT, row.seq.index, _position(batch.rows[r0 + j])))
                           for j in range(len(x))]
            i += len(x)
        return keyed_uniforms(i, seeded, self.generator, device)

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


def _drafts_with_probs(plan: StepPlan, seqs: Mapping[int, "Sequence"], draft_probs: Mapping[int, tuple]
                       ) -> tuple[list, list]:
    """(first sample row, chain tokens, q rows) per chain and (first sample row, tree, q rows) per tree, for each
    sampled (not greedy) sequence whose planned draft is a topological prefix of a draft drawn with probabilities;
    any other draft keeps sample-then-match (lossless for every draft)."""
    chains, trees = [], []
    for c in plan.seqs:
        entry = draft_probs.get(c.seq_id)
        if entry is None or not c.samples or not c.draft:
            continue
        tree, q = entry
        k = len(c.draft)
        if q is None or q.shape[0] < k or tree.prefix(k) != c.draft or seqs[c.seq_id].params.greedy:
            continue
        if c.draft.is_chain:
            chains.append((c.sample_start, c.draft.tokens, q[:k]))
        elif all(len(kids) == len(set(kids)) for kids in _sibling_tokens(c.draft)):
            trees.append((c.sample_start, c.draft, q[:k]))
    return chains, trees


def _sibling_tokens(tree) -> list[list[int]]:
    kids: dict[int, list[int]] = {}
    for i, t in enumerate(tree.tokens):
        kids.setdefault(tree.parent(i), []).append(t)
    return list(kids.values())


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
