"""Self-speculation by layer skipping (SWIFT-style, no training): the draft is the target itself with some of its
decoder layers skipped.

    speculative_config={"method": "layer_skip", "num_speculative_tokens": k}                  # skip set searched
    speculative_config={"method": "layer_skip", "skip": [3, 5, 7, ...], "threshold": 0.5}     # a fixed skip set

**KV: the draft reads the target's cache and writes only scratch blocks.** A decoding sequence has the target's
(full-model) KV for every committed token but the last. The draft runs the kept layers over the last committed
token and then over its own draft tokens, attending, at each kept layer, to the *target's* KV of the committed
prefix (as SWIFT and Draft & Verify do: the full model's keys are the best context the draft can have, and they
cost nothing) and to the KV its own tokens wrote. Those writes go to **scratch blocks**: extra blocks at the end of
the target's KV pool that the block manager never hands out (``ModelRunner.num_scratch_blocks``). The draft's block
table is the target's up to the block holding the last committed token, then scratch blocks; the target's part of
that partly filled block is copied into the first scratch block first. So the draft never writes a slot the target
owns: the target's KV cannot be corrupted whatever the draft does, and nothing has to be rolled back (the
alternative, writing draft KV into the target's own future slots for verification to overwrite, would need those
blocks allocated before the scheduler runs, and would leave a stale slot wherever a draft was cut). Scratch room is
reused from one group of sequences to the next, so it is small: ``ceil((block_size - 1 + k) / block_size)`` blocks
per sequence for at most 64 sequences drafting at once (a larger batch drafts in groups).

**Drafting**, batched over the sequences of a group: one forward per draft position through the kept layers, the
final norm and the LM head; each position's logits are processed like the request's sampler and the token drawn
from that q (``DraftSampler``, shared with spec/draft_model.py), so sampled requests are verified with
min(1, p/q) (exact), greedy ones by argmax matching (identical output). A sequence stops drafting early when the
draft's probability of its own token falls below ``threshold`` (SpecDec++ / Kangaroo's early exit of the draft).

**Int8 weights** (``int8``; by default on a float32 CPU target where int8 matmuls measure faster than float, and not
where the target reads a GGUF file's 4- or 8-bit codes, which are no more bytes: ``model/int8_linear.py``): the
draft runs the target's layers from an int8 copy of their weights (per output channel; norms, embedding and KV
shared with the target, which stays float) and an int8 LM head. At batch 1 a CPU step is bound by reading weights,
so a draft token through the whole int8 model costs about half a float step while agreeing with the target on ~90%
of tokens (SmolLM2-135M, greedy: 147 of 161 draft tokens accepted); the search then starts from the whole model (no
layer skipped) and may still skip layers. This is self-speculation with a quantized copy of the target (as in QSpec
and similar work), no training needed; verification stays exact. Memory: one byte per weight of the layers and the
LM head on top of the float model.

**The skip set** (unless ``skip`` fixes it) is searched on the fly from the live acceptance of the current
workload, as SWIFT does, with a simple local search instead of its Bayesian optimisation: the first and last
layers are always kept; the start skips every other layer of the middle half; each resolved draft is scored by
how many of its tokens the committed continuation matches (exactly the accepted count when the draft was verified
whole); after ``window`` resolved drafts the incumbent's value, tokens gained per unit of cost

    (accepted + 1 per draft) / (drafts + c(kept) * draft tokens),   c = (kept + H) / (L + H)

(a verification counts 1, a draft token costs the kept fraction of a full forward, where the LM head counts as H
layers by its parameters: 8 of SmolLM2-135M's 30, so its cost is not forgotten), is compared with a candidate
that skips one layer more or one fewer (chosen at random) evaluated over the next window; the better one stays.
Incumbent statistics decay, so the set follows the workload. The goodput controller, fed the drafter's measured
time, still decides whether drafting pays at all, valuing each token by the draft's calibrated confidence
(:class:`~leapdecode.spec.calibration.ChainCalibration`: how often tokens drafted with such a probability were
accepted; the raw product of the draft's probabilities claimed 0.1-0.5 a token where 0.91 were accepted).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from leapdecode.engine.input_batch import InputBuffers
from leapdecode.engine.step import ScheduledSeq, lay_out
from leapdecode.spec.calibration import ChainCalibration
from leapdecode.spec.draft_model import DraftSampler, RowCost, _Ctx, draft_chains, run_layers
from leapdecode.spec.drafter import Draft, DraftRequest

MAX_GROUP = 64          # sequences drafting at once (scratch room is sized for this many)


def scratch_blocks_needed(block_size: int, k: int, max_num_seqs: int) -> int:
    """Scratch blocks the target's pool needs for layer-skip drafts of up to ``k`` tokens."""
    return min(max_num_seqs, MAX_GROUP) * _per_seq(block_size, k)


def _per_seq(block_size: int, k: int) -> int:
    return -(-(block_size - 1 + max(k, 1)) // block_size)


@dataclass
class _Score:
    drafts: float = 0.0
    accepted: float = 0.0
    drafted: float = 0.0

    def value(self, kept_fraction: float) -> float:
        if self.drafts <= 0:
            return 0.0
        return (self.accepted + self.drafts) / (self.drafts + kept_fraction * self.drafted)

    def decay(self, f: float) -> None:
        self.drafts, self.accepted, self.drafted = f * self.drafts, f * self.accepted, f * self.drafted


class LayerSkipDrafter:
    """See the module docstring. ``skip``: fixed layers to skip (no search); ``threshold``: early-exit
    confidence; ``window``: resolved drafts per search evaluation; ``seed``: the search's random choices."""

    def __init__(self, runner: Any, num_speculative_tokens: int = 4, skip: Sequence[int] | None = None,
                 threshold: float = 0.3, window: int = 24, seed: int = 0, int8: bool | None = None) -> None:
        from leapdecode.model import int8_linear
        self.runner = runner
        self.model = runner.model
        self.L = len(self.model.layers)
        int8_cost = int8_linear.choose(int8, runner.dtype, runner.device, self.model.layers[0].mlp.gate_up_proj,
                                       "layer_skip")
        self.int8 = int8_cost is not None
        self.k = max(1, int(num_speculative_tokens))
        self.block_size = runner.block_size
        self.threshold = float(threshold)
        self.window = int(window)
        self.rng = random.Random(seed)
        per = _per_seq(self.block_size, self.k)
        scratch = getattr(runner, "num_scratch_blocks", 0)
        self.group = scratch // per
        if self.group < 1:
            raise ValueError("the layer_skip drafter needs scratch KV blocks in the target's pool "
                             "(ModelRunner.num_scratch_blocks); build the engine with method='layer_skip'")
        self.per_seq = per
        first = runner.num_blocks                      # scratch blocks follow the block manager's pool
        self.scratch = [list(range(first + g * per, first + (g + 1) * per)) for g in range(self.group)]
        # touch them once now: the pool's pages are mapped at first write, and the first draft's copy into them paid
        # for that inside a decode step (~160-220 ms on the 2-core VM, the first draft of a run 0.57x of plain)
        bs = runner.block_size
        slots = torch.arange(first * bs, (first + self.group * per) * bs, device=runner.device)
        runner.kv_cache.copy_slots(slots, slots)
        if self.L < 3:
            raise ValueError(f"layer_skip needs a model with at least 3 layers, this one has {self.L}")
        if skip is not None:
            bad = [i for i in skip if not (isinstance(i, int) and 0 <= i < self.L)]
            if bad or (not skip and not self.int8) or len(set(skip)) >= self.L:
                raise ValueError(f"speculative_config.skip must list layers in [0, {self.L}), skip at least one "
                                 f"(none only with int8 drafting) and keep at least one, got {list(skip)}")
            self.fixed = True
            self.skip = frozenset(skip)
        else:
            self.fixed = False
            # int8 drafting starts from the whole model (its drafts differ from the target's by quantization only)
            self.skip = frozenset() if self.int8 else frozenset(range(max(1, self.L // 4), max(2, 3 * self.L // 4), 2))
        self.draft_model, self.lm_int8, self.weight_cost = self.model, None, 1.0
        if self.int8:
            names = [f"layers.{n}" for n in int8_linear.linear_names(self.model.layers)]
            self.draft_model = int8_linear.int8_copy(self.model, names)
            self.lm_int8 = int8_linear.Int8Linear(self.model.output_head.weight)
            self.weight_cost = int8_cost
        self.buffers = InputBuffers(runner.device, capacity=1 << 12)
        self.sampler = DraftSampler(runner.model_cfg.vocab_size, runner.device, runner.cfg.seed)
        self.vocab_size = runner.model_cfg.vocab_size
        per_layer = sum(p.numel() for p in self.model.layers[0].parameters())
        self.head_layers = runner.model_cfg.vocab_size * runner.model_cfg.hidden_size / max(per_layer, 1)
        # search state: the incumbent's score, and a candidate under evaluation
        self.score = _Score()
        self.candidate: frozenset | None = None
        self.cand_score = _Score()
        self.pending: dict[int, tuple[int, tuple[int, ...], frozenset]] = {}   # seq_id -> (start, draft, skip set)
        self.stats = {"forwards": 0, "drafted": 0, "switches": 0, "evaluations": 0, "seconds": 0.0}
        self.calibration = ChainCalibration()     # what the drafts' confidences are worth (spec/calibration.py)
        self.row_cost = RowCost()                 # what a draft position costs a row (the stopping rule)

    # -- the skip set ------------------------------------------------------------------------------------------
    @property
    def active_skip(self) -> frozenset:
        return self.candidate if self.candidate is not None else self.skip

    def _kept(self, skip: frozenset) -> list[int]:
        return [i for i in range(self.L) if i not in skip]

    def _cost(self, skip: frozenset) -> float:
        """A draft token's cost as a fraction of a full forward: kept layers plus the LM head (in layers), times
        int8's measured cost over float's when the draft reads int8 weights."""
        return self.weight_cost * (len(self._kept(skip)) + self.head_layers) / (self.L + self.head_layers)

    def _mutate(self) -> frozenset:
        middle = range(1, self.L - 1)
        skipped = [i for i in middle if i in self.skip]
        kept = [i for i in middle if i not in self.skip]
        fewest = 0 if self.int8 else 1          # the float draft never runs the full model: it would be the target
        if kept and (len(skipped) <= fewest or self.rng.random() < 0.5):
            return self.skip | {self.rng.choice(kept)}
        return self.skip - {self.rng.choice(skipped)}

    def _record(self, skip: frozenset, accepted: int, drafted: int) -> None:
        if self.fixed:
            return
        s = self.cand_score if skip == self.candidate else self.score if skip == self.skip else None
        if s is None:
            return
        s.drafts += 1
        s.accepted += accepted
        s.drafted += drafted
        if self.candidate is None and self.score.drafts >= self.window:
            self.candidate = self._mutate()
            self.cand_score = _Score()
        elif self.candidate is not None and self.cand_score.drafts >= self.window:
            self.stats["evaluations"] += 1
            c_val = self.cand_score.value(self._cost(self.candidate))
            s_val = self.score.value(self._cost(self.skip))
            if c_val > s_val:
                self.skip, self.score = self.candidate, self.cand_score
                self.stats["switches"] += 1
            self.candidate = None
            self.score.decay(0.5)

    # -- the forward -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def hidden(self, chunks: list[tuple[int, Sequence[int], Sequence[int]]], layers: list[int],
               final_norm: bool = True) -> torch.Tensor:
        """The draft's hidden state of each chunk's last token: ``chunks`` (start position, tokens, block table)
        through ``layers`` of the target (reading its KV, writing the tables' scratch blocks), then the final norm
        unless ``final_norm`` is False (the residual stream, as ``ModelRunner.execute(capture=...)`` numbers it)."""
        plan = lay_out(0, self.block_size, [ScheduledSeq(i, start, tuple(toks), tuple(blocks), samples=True)
                                            for i, (start, toks, blocks) in enumerate(chunks)])
        batch = self.buffers.build(plan, self.runner.model_cfg.sliding_window)
        self.runner.backend.plan(batch.meta)
        hidden = run_layers(self.draft_model, batch.input_ids, batch.meta, layers, final_norm)[batch.logits_indices]
        self.stats["forwards"] += 1
        return hidden

    @torch.inference_mode()
    def forward(self, chunks: list[tuple[int, Sequence[int], Sequence[int]]], layers: list[int],
                seq_ids: Sequence[int] = ()) -> torch.Tensor:
        """Logits of each chunk's next token (``seq_ids``: whose chunk each is; read by subclasses that keep
        per-sequence state, spec/kangaroo.py)."""
        hidden = self.hidden(chunks, layers)
        return self.model.compute_logits(hidden) if self.lm_int8 is None else self.lm_int8(hidden)

    # -- the protocol ------------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        out = [Draft() for _ in requests]
        live = [i for i, r in enumerate(requests)
                if r.max_draft > 0 and len(r.token_ids) >= 2 and r.block_table]
        skip = self.active_skip
        layers = self._kept(skip)
        for g in range(0, len(live), self.group):
            self._draft_group(requests, live[g:g + self.group], layers, skip, out)
        self.stats["seconds"] += time.perf_counter() - t0
        return out

    def _draft_group(self, requests, idx: list[int], layers: list[int], skip: frozenset, out: list[Draft]) -> None:
        bs = self.block_size
        tables, src, dst, chunks, ctxs = [], [], [], [], []
        for slot, i in enumerate(idx):
            r = requests[i]
            last = len(r.token_ids) - 1                   # position of the last committed token: no KV yet
            b0 = last // bs
            scratch = self.scratch[slot]
            table = list(r.block_table[:b0]) + scratch
            for o in range(last - b0 * bs):               # the target's part of the block the draft writes into
                src.append(r.block_table[b0] * bs + o)
                dst.append(scratch[0] * bs + o)
            tables.append(table)
            chunks.append((last, (r.token_ids[last],), table))
            ctxs.append(_Ctx(r))
        if src:
            dev = self.runner.device
            self.runner.kv_cache.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        def step(active: list[int], depth: int, last: list[int]) -> torch.Tensor:
            return self.forward([(len(requests[idx[b]].token_ids) - 1 + depth, (t,), tables[b])
                                 for b, t in zip(active, last)], layers, [requests[idx[b]].seq_id for b in active])

        limits = [min(requests[i].max_draft, self.k) for i in idx]
        first = self.forward(chunks, layers, [requests[i].seq_id for i in idx])
        drafts = draft_chains(self.sampler, first, ctxs, limits, self.threshold, step,
                              self.calibration, self.row_cost)
        for i, draft in zip(idx, drafts):
            r = requests[i]
            out[i] = draft
            self.pending[r.seq_id] = (len(r.token_ids), tuple(draft.tokens), skip)
            self.stats["drafted"] += len(draft.tokens)

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int, topk=None) -> None:
        """Score the sequence's last draft against the tokens committed since (see the module docstring)."""
        self.calibration.observe(seq_id, token_ids)
        pending = self.pending.pop(seq_id, None)
        if pending is None:
            return
        start, draft, skip = pending
        new = token_ids[start:]
        m = 0
        while m < len(draft) and m < len(new) and new[m] == draft[m]:
            m += 1
        self._record(skip, m, len(draft))

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.pending.pop(seq_id, None)
        self.calibration.finish(seq_id, token_ids)
