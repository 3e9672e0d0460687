"""Structured output inside the step: each constrained sequence's grammar matcher, its drafts, and its masks.

- At submission the spec is compiled (cached, time-limited; a bad spec is a ValueError then, never later).
- Before scheduling, tokens the grammar forces (``{"name": "``) become the sequence's draft proposal: the mask
  leaves one token allowed there, so verification accepts them with certainty and boilerplate costs no extra
  forward pass. Drafts from a drafter are cut at the first token the grammar refuses (trees are reduced to their
  first chain).
- During the forward pass a worker thread fills one bitmask row per sample row of the plan (each draft node and
  the bonus); the rows are applied to the logits on the device, for the whole batch at once, before sampling.
- After verification the matcher accepts exactly the committed tokens.
- Grammar-aligned sampling (opt-in, ``SamplingParams(grammar_aligned=True)``): one ASAp trie per (prompt, grammar)
  learns from finished samples how much probability each prefix keeps under the grammar, and reweights the masked
  distribution with it, so repeated sampling converges to the model's distribution conditioned on the grammar.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import StepPlan
from leapdecode.spec.tree import DraftTree

MAX_ASAP_TRIES = 64


class StructuredOutput:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._eos = sorted(eos_token_ids)
        self._backend = None
        self.matchers: dict[int, Any] = {}      # seq_id -> Matcher
        self.tries: OrderedDict[tuple, Any] = OrderedDict()   # (prompt, spec) -> AsapTrie, LRU
        self.aligned: dict[int, Any] = {}       # seq_id -> its AsapTrie
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")
        self.num_forced_tokens = 0

    @property
    def backend(self):
        if self._backend is None:
            from leapdecode.structured import GrammarBackend
            tok_eos = self._tokenizer.eos_token_id
            eos = [tok_eos] if tok_eos is not None else self._eos[:1]
            self._backend = GrammarBackend(self._tokenizer, eos_token_ids=eos, cache_size=self._cache_size)
        return self._backend

    def compile(self, structured: dict[str, Any]):
        """Validate and compile at submission; every problem is a ValueError naming it."""
        return self.backend.compile(structured)

    def attach(self, seq: Sequence, compiled) -> None:
        self.matchers[seq.seq_id] = self.backend.matcher(compiled)
        if seq.params.grammar_aligned:
            from leapdecode.structured import AsapTrie
            key = (tuple(seq.token_ids[:seq.num_prompt_tokens]), json.dumps(seq.params.structured, sort_keys=True))
            trie = self.tries.pop(key, None) or AsapTrie()
            self.tries[key] = trie
            if len(self.tries) > MAX_ASAP_TRIES:
                self.tries.popitem(last=False)
            self.aligned[seq.seq_id] = trie

    def detach(self, seq: Sequence) -> None:
        """The sequence is done: forget its matcher; an aligned sample teaches its trie."""
        self.matchers.pop(seq.seq_id, None)
        trie = self.aligned.pop(seq.seq_id, None)
        if trie is not None and seq.finish_reason in ("stop", "length"):
            trie.update(seq.output_token_ids)

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self.matchers

    # -- before scheduling ---------------------------------------------------------------------------------------
    def draft(self, seq: Sequence, proposal: DraftTree, room: int) -> DraftTree:
        """Forced tokens become the draft; otherwise the drafter's proposal is cut to what the grammar allows."""
        m = self.matchers[seq.seq_id]
        forced = m.forced_tokens()[:room] if room > 0 else []
        if forced:
            self.num_forced_tokens += len(forced)
            return DraftTree.of(forced)
        chain = proposal.first_chain()
        return chain.prefix(m.validate(list(chain.tokens))) if chain else chain

    # -- around the forward pass ---------------------------------------------------------------------------------
    def start_fill(self, plan: StepPlan) -> Future | None:
        """One bitmask row per sample row of the plan, filled in a worker thread while the model runs."""
        jobs = [(self.matchers[c.seq_id], c.sample_start, list(c.draft.tokens))
                for c in plan.seqs if c.samples and c.seq_id in self.matchers]
        if not jobs:
            return None
        from leapdecode.structured import allocate_token_bitmask, fill_bitmasks
        bitmask = allocate_token_bitmask(plan.num_samples, self.backend.vocab_size)
        rows = [row + i for _, row, draft in jobs for i in range(len(draft) + 1)]

        def fill() -> tuple[torch.Tensor, list[int]]:
            # no PyTorch op in this thread (numpy views, numpy indexing and the grammar library): a parallel op here
            # would give it OpenMP workers of its own and slow every step of the process (native.py,
            # release_openmp_threads)
            fill_bitmasks(jobs, bitmask)
            return torch.from_numpy(bitmask.numpy()[rows]), rows

        return self._pool.submit(fill)

    @staticmethod
    def apply(logits: torch.Tensor, pending: Future | None) -> torch.Tensor:
        if pending is None:
            return logits
        from leapdecode.structured import apply_token_bitmask
        bitmask, rows = pending.result()
        return apply_token_bitmask(logits.clone(), bitmask, rows=rows)

    def align(self, rows: list, probs: torch.Tensor, unmasked_probs, pending: Future | None) -> torch.Tensor:
        """Replace the masked distribution of grammar-aligned rows by ASAp's reweighted one.
        ``rows[r]`` is a sampler Row (sequence + draft path); ``unmasked_probs()`` computes the unmasked ones."""
        targets = [r for r, row in enumerate(rows) if row.seq.seq_id in self.aligned]
        if not targets or pending is None:
            return probs
        from leapdecode.structured import bitmask_to_bool
        bitmask, mask_rows = pending.result()
        allowed = bitmask_to_bool(bitmask, probs.shape[-1])
        where = {r: i for i, r in enumerate(mask_rows)}
        full = unmasked_probs()
        probs = probs.clone()
        for r in targets:
            row = rows[r]
            prefix = row.seq.output_token_ids + list(row.history)
            probs[r] = self.aligned[row.seq.seq_id].reweight(prefix, full[r], allowed[where[r]]).to(probs.dtype)
        return probs

    # -- after verification --------------------------------------------------------------------------------------
    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance the matcher; returns why the sequence must end ("stop" when the grammar is complete, "abort"
        or "abort: <why>" (e.g. the grammar library's own error message) when no valid continuation exists), or
        None to go on."""
        m = self.matchers[seq.seq_id]
        if not m.accept(token):
            return f"abort: {m.error}" if m.error else "abort"
        if m.is_terminated():
            return "stop"
        if m.error is not None:
            return f"abort: {m.error}"
        return None

