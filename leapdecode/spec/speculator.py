"""Speculation inside the normal step: ask the drafter, let the controller size the drafts, learn from results.

The speculator only *proposes*: it returns one draft tree per decoding sequence, which the scheduler copies into
the step plan (trimmed to the budget). The engine verifies drafts in the same forward pass and the same sampler
as plain decoding (``sampling/verifier.py``), so a sequence with no draft takes exactly the plain path.

With the adaptive controller, a step where no draft can pay (the controller's cost and acceptance models say so)
does not ask the drafter for everyone: it keeps one *shadow* draft per request, proposed when the previous one is
resolved, and scores it against the tokens plain decoding then commits (sample-then-match accepts exactly the
common prefix of a draft and the tokens plain decoding draws). So acceptance keeps being learned while speculation
is off, at a fraction of the drafting cost, and speculation comes back when the text starts to copy.

Drafting time is charged by who spent it. ``auto`` with a model drafter inside (spec/auto.py) reports the model
drafter's time apart: the controller charges the free drafters' time on every drafting step and the model
drafter's only on the steps that ask it, and before it is asked, :meth:`Speculator._costly_pays` checks that its
promised accepted tokens pay for its measured time and the longer verification (one ask in 32 goes through
anyway, so its record stays current). One averaged drafting time would charge the model drafter's cost to suffix
matches and turn drafting off where they alone pay.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence as Seq

from leapdecode.config import SpeculativeConfig
from leapdecode.spec.controller import STALE_BATCH, Controller, StepTimeModel
from leapdecode.spec.drafter import DraftRequest
from leapdecode.spec.guard import ThroughputGuard
from leapdecode.spec.registry import MODEL_METHODS, make_drafter
from leapdecode.spec.tree import DraftTree

if TYPE_CHECKING:
    from leapdecode.engine.sequence import Sequence


OFFER_FLOOR = 0.02
"""With the controller on, a calibrated drafter offers every token at least this likely to be accepted."""

CONTROLLED_AUTO = {"fallback": True, "min_accept_prob": OFFER_FLOOR}
"""What an ``auto`` drafter is built with when the controller is on (unless its options say otherwise): its members'
own drafts in order (spec/auto.py, ``fallback``), which the controller values and cuts itself; and, where a user
asks for the calibrated draft (``fallback=False``), every token at least ``OFFER_FLOOR`` likely. Options that choose
another way of drafting (``calibrate``, ``fill``, ``min_accept_prob``) keep it: no ``fallback`` is set then."""
_AUTO_MODES = ("fallback", "calibrate", "fill", "min_accept_prob")

QUIET_SHARE = 0.02
"""While speculation is off, shadow drafts cost at most about this share of the decoding time (at batch 64 on an
H200 a shadow draft of every request cost 1-45 ms against a 2 ms step), less where drafting could gain little at
best (:meth:`Speculator._potential`)."""

SHADOW_BANK = 8
"""Quiet steps' worth of unspent shadow credit kept (a costlier shadow still runs: the credit then goes negative and
is earned back). With 64, the credit banked over a run paid for ~2 ms of shadows in each of the first quiet steps
of the next batch of 64 requests on the CPU."""

VALUE_RATE = 0.15
"""Weight of one request's newest draft in the running value that keeps drafting on (see :meth:`Speculator.propose`):
a step that drafted for R requests weighs 1 - (1 - VALUE_RATE) ** R, as R drafts would, its value being already an
average over them. (Weighed as one draft, at batch 16 on the CPU a good step kept drafting on for ~5 steps that kept
no draft at all, each spending ~5% of its time drafting for 16 requests; at batch 64, 3 steps of ~8 ms each.) At
batch 1 a model drafter's drafts vary from position to position, and 0.15 keeps drafting on through a few short
ones: four runs each on the CPU (benchmarks README, session 19), layer_skip+ctl and eagle+ctl on GSM8K and HumanEval
1.24-1.40x (means per cell) with 0.15 against 1.06-1.27x with 0.3, MT-Bench 0.94-1.11x against 0.96-1.09x; with 0.3
two of the eight runs had a drafter that never drafted again after the chat prompts."""

RETRY_QUIET, RETRY_MAX = 8, 256
"""A model drafter's retries while quiet: a real draft after this many quiet steps, the wait doubling after each
retry that does not switch drafting back on (up to RETRY_MAX), new requests included, and back to RETRY_QUIET once
drafting pays. Its shadows are rare (QUIET_SHARE of a step buys one in ~30-100 steps at batch 1) and the quiet
re-check values a request by its last draft, often the short one that switched drafting off: layer_skip stayed
quiet for the rest of an answer where drafting gave 1.3x. Measured (layer_skip+ctl, batch 1, two runs each):
0.92-1.38x (mean 1.13) without retries, 0.94-1.39x (mean 1.23) with. (Started over with each new request, a
drafter that never paid retried once or twice per 48-token answer: on a CPU target reading 4-bit codes a
layer_skip draft of 4 tokens costs ~2 plain steps.)"""

RETRY_PAID = 8
"""Drafting steps a spell of speculation must last before a model drafter's retries are back to RETRY_QUIET; a retry
whose spell ends sooner counts as one that did not pay (its wait doubles). Reset by any spell, EAGLE on the CPU
(whose drafts did not pay at batch 1 on any task after session 26's faster step) retried every 8 quiet steps: a
retry's draft predicted at 1.07-1.13x switched drafting on for one to four steps, and each request drafted ~4 times
for nothing (~5% of the decoding time)."""

QUIET_TOPK_ROWS = 8
"""While speculation is off, the drafter learns the target's top-k from at most this many rows a step (see
:meth:`Speculator.learns_topk`)."""

CHECK_SHARE, CHECK_WAIT = 0.05, 8
"""... and the controller's re-checks (0.2 ms at batch 64 there) about this share, waiting at most CHECK_WAIT quiet
steps: at 2% a batch of 2 on an H200 waited ~30 steps between checks and never turned speculation on in 64 tokens of
copy-friendly text."""


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, step_time: StepTimeModel | None = None,
                 runner: object | None = None) -> None:
        """``runner``: the target's model runner, handed to drafters that run a model (``registry.MODEL_METHODS``)."""
        self.cfg = cfg
        self._vocab_size, self._runner = vocab_size, runner
        graphs = getattr(runner, "graphs", None)       # steps a CUDA graph replays cost their bucket's time
        self.controller = Controller(cfg.num_speculative_tokens, step_time,
                                     graph_bucket=graphs.shape_bucket if graphs is not None else None) \
            if cfg.adaptive else None
        self.guard = ThroughputGuard() if cfg.adaptive else None   # measured rates overrule the controller
        self._guard_bare = False               # this step runs without the drafter (the guard's bare mode)
        self._step_drafted = 0                 # draft tokens verified this step
        self.drafter = cfg.drafter if cfg.drafter is not None else self.new_drafter()
        self._probs: dict[int, tuple[DraftTree, object]] = {}   # this step's drafts' q (model drafters)
        self.num_proposals = 0
        self.num_shadow_proposals = 0
        self.drafter_seconds = 0.0       # total time inside the drafter (bounded: a sum, not a history)
        self.draft_seconds_ema = 0.0     # drafting time per speculating step, auto's model drafter excepted
        self._drafting_timed = False     # draft_seconds_ema holds a measurement beyond the drafter's first call
        self._warming_up = False         # the last call was that first one (the guard does not see its step)
        self.costly_seconds_ema = 0.0    # auto's model drafter: time per step that asks it
        self._backlog_seconds = 0.0      # the last propose's backlog (see _draft)
        self._gate_calls = 0
        self._step_shape = (0, 0)        # this step's (decoding requests, tokens computed anyway), for the gate
        self._token_batch = 1            # ... and the batch that decodes (what an accepted token is worth)
        # the model drafters' chains (alone or in auto) stop drafting by the controller's price of a token
        self._prices_tokens = self.controller is not None and bool({"draft_model", "layer_skip", "kangaroo", "eagle"}
                                                                   & set(cfg.model_methods))
        # this step's sequences when it holds decodes only (a CUDA graph's shape; the steps the guard compares);
        # None otherwise, and between steps
        self._decode_seqs: int | None = None
        self._step_draft_seconds = 0.0   # drafting time inside this step (charged apart, so not in its step time)
        self._decided = False            # drafter_off already asked the guard this step
        # seq_id -> (draft, committed tokens when drafted, its confidences' claims or None, its score)
        self._shadow: dict[int, tuple[DraftTree, int, list[float] | None, float]] = {}
        # while speculation is off, the controller is asked again only when something it uses has changed
        self._speculating = True
        # while speculating: a running average of what the drafting steps deliver against plain decoding, their
        # drafting time included (Controller.last_choice["value"]); drafting goes on while it is above 1
        self._value: float | None = None
        self._news = True                # acceptance observed, or the batch changed, since the last check
        self._batch: tuple[int, ...] = ()
        self._quiet_steps = 0
        self.shadow_gap = 4              # steps at least between a request's shadow drafts
        self._shadow_credit = 0.0        # seconds of shadow drafting earned (QUIET_SHARE of each quiet step), not spent
        self._shadow_cost: float | None = None   # measured seconds of one request's shadow draft (decayed)
        self._check_wait = 0             # quiet steps before the controller may be asked again (its own cost)
        self._steps = 0
        self._shadow_after: dict[int, int] = {}
        # a model drafter's shadows are rare (QUIET_SHARE of a step buys one in ~30-100 steps at batch 1), so while
        # quiet it drafts for real every _retry_after quiet steps, doubling after each retry that does not pay
        self._retries = self.controller is not None and cfg.method in MODEL_METHODS
        self._retry_after, self._retry_wait, self._retrying = RETRY_QUIET, 0, False
        self._spell, self._spell_retried = 0, False     # the current spell's drafting steps; it began with a retry
        self._topk_turn = 0              # the first of the rows a quiet step learns top-k from (learns_topk)
        # (decoding sequences, seconds) of the last decode-only step that verified nothing: what a quiet step costs,
        # measured (a prediction is ~55 us of numpy a call, ~1% of a batch-1 step of a CPU target reading 4-bit codes)
        self._plain_step: tuple[int, float] | None = None
        self._potential_memo: tuple | None = None     # (its step's shape, step count, _potential's value)

    def new_drafter(self):
        """A fresh drafter as the config says (benchmarks use it to start each run from empty caches)."""
        cfg = self.cfg
        options = dict(cfg.options)
        if cfg.method in ("recycling", "auto"):
            options.setdefault("vocab_size", self._vocab_size)
        if cfg.model_methods:            # a model drafter, alone or inside auto
            options.setdefault("num_speculative_tokens", cfg.num_speculative_tokens)
        if self.controller is not None and cfg.method == "auto":
            # the controller keeps the tokens that pay on this machine: the members' own drafts, or (calibrated)
            # nearly every token (the drafter's own bar is for running without a controller)
            chosen = any(key in options for key in _AUTO_MODES)
            for key, value in CONTROLLED_AUTO.items():
                if key != "fallback" or not chosen:
                    options.setdefault(key, value)
        return make_drafter(cfg.method, runner=self._runner, **options)

    @property
    def drafter(self):
        return self._drafter

    @drafter.setter
    def drafter(self, drafter) -> None:
        """Any drafter set here (the config's, a fresh one from :meth:`new_drafter`) gets auto's model-drafter gate
        when the controller is on."""
        if self.controller is not None and getattr(drafter, "costly", None) is not None:
            drafter.costly_gate = self._costly_pays
        self._drafter = drafter

    @property
    def speculating(self) -> bool:
        """False while the controller has turned speculation off (steps are plain decoding plus shadow drafts)."""
        return self.controller is None or self._speculating

    @property
    def wants_topk(self) -> bool:
        """Does the drafter learn from the target's top-k at verified positions (Token Recycling)?"""
        return bool(getattr(self.drafter, "wants_topk", False))

    def _draft(self, reqs: list[DraftRequest]):
        """(drafts, seconds in the free drafters, seconds in auto's model drafter). A drafter's online training
        (``last_train_seconds``, spec/online.py) is in neither: it is a bounded investment the user opted into
        (``OnlineConfig.max_share``); charged as drafting, it would turn off the very head that is learning. Nor
        is its backlog (``last_backlog_seconds``: catching up on tokens committed before the previous step, e.g.
        EAGLE's head over a new prompt, spec/eagle.py), which a drafter drafting every step does not pay again:
        in the drafting time per step it set the price of EAGLE drafts at 2-3x their steady cost at batch 1, and
        the controller kept a head off where it gave 1.2x. It is kept in ``_backlog_seconds`` for the shadows'
        budget, which spends real time."""
        t0 = time.perf_counter()
        if self._prices_tokens:          # a chain model drafter stops where a token stops paying (draft_chains)
            worth, verify = self.controller.token_prices(self._token_batch, self._step_shape[1], self._decode_seqs)
            for r in reqs:
                r.token_seconds, r.verify_seconds = worth, verify
        drafts = self.drafter.propose(reqs)
        return self._account(drafts, time.perf_counter() - t0)

    def _account(self, drafts: list, dt: float) -> tuple[list, float, float]:
        """:meth:`_draft`'s share-out of ``dt``, the drafter's wall time for ``drafts``."""
        self.drafter_seconds += dt
        self._step_draft_seconds += dt
        train = min(getattr(self.drafter, "last_train_seconds", 0.0), dt)
        # the drafter's first call (see _time_drafting); its callers count their calls after this
        self._warming_up = self.num_proposals + self.num_shadow_proposals == 0
        costly = min(getattr(self.drafter, "last_costly_seconds", 0.0), dt - train)
        self._backlog_seconds = min(getattr(self.drafter, "last_backlog_seconds", 0.0), dt - train - costly)
        if costly > 0:
            ema = self.costly_seconds_ema
            self.costly_seconds_ema = costly if ema == 0 else 0.8 * ema + 0.2 * costly
        return drafts, dt - train - costly - self._backlog_seconds, costly

    def _time_drafting(self, seconds: float) -> None:
        """Fold one drafting step's free-drafter time into ``draft_seconds_ema``, the charge of a drafting step.
        Shadow drafts of every request count too: timed only when it drafted for real, a charge seeded by one slow
        draft (a burst of load) stayed wrong for as long as it kept the drafter off. The drafter's first call
        (one-off costs) only stands in until the next measurement replaces it, and the guard does not see its step:
        layer_skip's took 250-280 ms against 45 ms after it (kernels set up on first use), and priced by it, the
        controller never drafted again (SmolLM2-135M, batch 1, CPU; alone it gave 1.37x)."""
        if self._warming_up or not self._drafting_timed:    # the first call, or the measurement that replaces it
            self._drafting_timed = not self._warming_up
            self.draft_seconds_ema = seconds
        else:
            self.draft_seconds_ema = 0.8 * self.draft_seconds_ema + 0.2 * seconds

    def _costly_pays(self, reqs: list[DraftRequest], promises: list[float]) -> bool:
        """Auto's gate: do the model drafter's promised accepted tokens for ``reqs`` beat plain decoding, charged
        its measured time and the verification of its drafts? Always yes until its time is measured, and on one
        call in 32 (its record, which makes the promises, is only updated when it drafts)."""
        self._gate_calls += 1
        if self.costly_seconds_ema <= 0 or self._gate_calls % 32 == 0:
            return True
        ctl, (decodes, base) = self.controller, self._step_shape
        rooms = [min(r.max_draft, self.cfg.num_speculative_tokens) for r in reqs]
        cheap, seqs = self.draft_seconds_ema, self._decode_seqs
        plain = decodes / (ctl.step_seconds(base, seqs) + cheap)
        spec = (decodes + sum(promises)) / (ctl.step_seconds(base + sum(rooms), seqs, 1 + max(rooms, default=0))
                                            + cheap + self.costly_seconds_ema)
        return spec > plain * (1.0 + ctl.min_gain)

    def prepare(self, prefilling: list["Sequence"], num_seqs: int = 1) -> None:
        """Let the drafter catch up with the prompt tokens already prefilled (``num_computed_tokens``), chunk by
        chunk: indexing an 8,000-token prompt at once costs ~30 ms inside the first decode step otherwise. The time
        counts as the drafter's, not the step's. ``num_seqs``: the running sequences (nothing is indexed while the
        guard has the drafter off at that batch size)."""
        prepare = getattr(self.drafter, "prepare", None)
        if prepare is None or not prefilling or self.off(num_seqs):   # (a drafter that is off catches up later)
            return
        start = time.perf_counter()
        for seq in prefilling:
            prepare(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])
        self._step_draft_seconds += time.perf_counter() - start

    def drafter_off(self, num_decoding: int, other_tokens: int) -> bool:
        """The guard's decision for this step, asked before anything is built for the drafter (at batch 64 the
        requests and their draft rooms cost a vetoed step ~6% more host time, measured on the CPU): True = no
        drafter this step.
        Once per step; a step that goes on calls :meth:`propose`, which then does not ask again."""
        off = self._guard_says_off(num_decoding, other_tokens)
        self._decided = not off
        return off

    def _guard_says_off(self, num_decoding: int, other_tokens: int) -> bool:
        """Ticks the guard's clock on a decode-only step (its bare windows and vetoes); with prefill chunks the
        step is not compared, but a veto holds for it too."""
        self._decode_seqs = num_decoding if other_tokens == 0 else None
        if self.guard is None:
            return False
        if self._decode_seqs is not None:
            self._guard_bare = self.guard.bare(self._decode_seqs)
            return self._guard_bare
        return self.guard.vetoed(num_decoding)

    def propose(self, decoding: list["Sequence"], rooms: list[int], other_tokens: int,
                batch: int | None = None) -> dict[int, DraftTree]:
        """One draft per decoding sequence that has room for one (``Scheduler.draft_room``: never a Mirostat
        request); ``other_tokens``: tokens the step computes anyway besides the decodes' own (prefill chunks), for
        the controller's cost model; ``batch``: the sequences that will decode together once those prompts are in
        (what an accepted token is worth in a step with prefill chunks). (The drafter's time of this step,
        ``_step_draft_seconds``, started with ``prepare`` and is reset by ``observe_step``.)"""
        self._probs = {}
        if self._decided:               # the engine asked drafter_off first
            self._decided = False
        elif self._guard_says_off(len(decoding), other_tokens):
            return {}
        reqs, seqs = [], []
        for seq, room in zip(decoding, rooms):
            room = min(self.cfg.num_speculative_tokens, room)
            if room > 0:
                reqs.append(DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, room, seq.params,
                                         seq.index, seq.block_table))
                seqs.append(seq)
        if not reqs:
            self._guard_bare = True     # no room for a draft anywhere: a plain step, for the guard
            return {}
        ctl = self.controller
        base = len(decoding) + other_tokens
        self._step_shape = (len(decoding), base)
        self._token_batch = max(len(decoding), batch or 0)
        if ctl is not None and not self._speculating:
            ids = tuple(r.seq_id for r in reqs)
            self._quiet_steps += 1
            if ids != self._batch:          # new requests: a model drafter's retry wait starts over (not its length)
                self._retry_wait = 0
            if ids != self._batch or self._quiet_steps >= 8:        # (the count restarts: every 8 steps, not
                self._news, self._batch, self._quiet_steps = True, ids, 0     # every step after the 8th)
            plain = self._plain_step             # what this quiet step costs: its last measure, else predicted
            step = plain[1] if plain is not None and plain[0] == self._decode_seqs else \
                ctl.step_seconds(base, self._decode_seqs)
            if not (self._news and self._worth_drafting(reqs, base, step, batch)) and not self._retry_due():
                self._propose_shadows(reqs, step)
                return {}
            self._quiet_steps = 0
        drafts, dt, costly = self._draft(reqs)
        self.num_proposals += 1
        self._time_drafting(dt)
        for s, d in zip(seqs, drafts):
            if d.probs is not None and d.tokens:
                self._probs[s.seq_id] = (DraftTree.of(d.tokens, d.parents), d.probs)
        if ctl is None:
            return {s.seq_id: DraftTree.of(d.tokens, d.parents) for s, d in zip(seqs, drafts) if d.tokens}
        # the drafts are made: judge them by what this drafting cost (a draft model that stopped after one
        # confident token costs a quarter of a four-token draft; charged the average, such a draft looked like a
        # loss and pulled the running value down), save the first call's one-off costs
        charge = self.draft_seconds_ema + (self.costly_seconds_ema if costly > 0 else 0.0) if self._warming_up \
            else dt + costly
        trees = [DraftTree.of(d.tokens, d.parents) if d.tokens else None for d in drafts]
        # a step with a token tree runs eagerly (engine/cuda_graphs.py step_shape): price it by its tokens
        chains = all(t is None or t.parents is None for t in trees)
        keep = ctl.draft_lengths([(s.seq_id, len(d), d.score, d.confidence) for s, d in zip(seqs, drafts)], base,
                                 charge, self._decode_seqs, trees=not chains, sunk=True, batch=batch)
        # drafting goes on while it pays on average over the last few drafting steps, drafting time included (the
        # drafts in hand are kept by what they gain now that their time is spent): a draft's worth varies from
        # position to position (EAGLE's head is sure of one token and not of the next), and switched off by one
        # modest draft, drafting came back only once a quiet re-check saw a confident shadow. A plain step the
        # controller chose to time plain decoding (an exploration) does not switch speculation off either.
        value = ctl.last_choice.get("value")      # (None only from a controller that does not price drafts in hand)
        if value is None:
            on = any(keep)
        else:
            kept = (1.0 - VALUE_RATE) ** len(seqs)       # a step of R drafts weighs as R drafts
            self._value = value if self._value is None else kept * self._value + (1.0 - kept) * value
            on = self._value > 1.0 + ctl.min_gain
        self._speculating = on or bool(ctl.last_choice.get("explored"))
        if not self._speculating:
            self._value = None
        if self._speculating:
            if self._spell == 0:
                self._spell_retried = self._retrying
            self._spell += 1
            if self._spell >= RETRY_PAID:   # drafting has paid for a while: a later quiet spell retries early
                self._retry_after = RETRY_QUIET
        else:
            if self._retrying or (self._spell_retried and self._spell < RETRY_PAID):
                self._retry_after = min(2 * self._retry_after, RETRY_MAX)   # a retry that did not pay waits longer
            self._spell, self._spell_retried = 0, False
        self._retrying = False
        out = {}
        for s, d, tree, k in zip(seqs, drafts, trees, keep):
            if k > 0:
                out[s.seq_id] = tree.prefix(k)
                if s.seq_id in self._shadow:
                    self._score_shadow(s, given_up=True)
            elif tree is not None and s.seq_id not in self._shadow:
                self._shadow[s.seq_id] = (tree, len(s.token_ids), _claim(d), d.score)
        return out

    def learns_topk(self) -> bool | frozenset[int]:
        """Which rows of this step the drafter learns the target's top-k from: True (every row), False (none) or
        the sequence ids of the rows. None of them while the guard keeps the drafter off (a veto or a bare
        window); while the controller keeps speculation off, at most ``QUIET_TOPK_ROWS`` sequences a step, in
        turn: at batch 64 on the CPU the top-k of every row (~1 ms a step) and Token Recycling's table updates
        (~1 ms more) were a quiet speculator's cost beyond its shadows' budget. While drafting, every row."""
        if not self.wants_topk or self._guard_bare:
            return False
        ids = self._batch
        if self.controller is None or self._speculating or len(ids) <= QUIET_TOPK_ROWS:
            return True
        start = self._topk_turn % len(ids)
        self._topk_turn = start + QUIET_TOPK_ROWS
        return frozenset(ids[start:start + QUIET_TOPK_ROWS] + ids[:max(0, start + QUIET_TOPK_ROWS - len(ids))])

    def off(self, num_seqs: int) -> bool:
        """The guard has the drafter off for the next step of ``num_seqs`` sequences (``ThroughputGuard.off``): it
        may run overlapped."""
        return self.guard is not None and self.guard.off(num_seqs)

    def overlapped_step(self, decode_seqs: int | None) -> None:
        """The engine runs a step without asking the drafter (overlapped, while :meth:`off`): the guard's clock
        still counts it. ``decode_seqs``: its sequences if it holds decodes only, else None."""
        if self.guard is not None and decode_seqs is not None:
            self.guard.bare(decode_seqs)

    def observe_overlapped(self, decode_seqs: int | None, seconds: float, emitted: int) -> None:
        """An overlapped step's time from step to step (a bare step at plain decoding's best). The controller's
        step-time model is left alone: it prices synchronous steps."""
        if self.guard is not None and decode_seqs is not None:
            self.guard.record(decode_seqs, "bare", seconds, emitted)

    def take_probs(self) -> dict[int, tuple[DraftTree, object]]:
        """The draft distributions of the drafts the last ``propose`` returned: seq_id -> (the drafter's tree, q
        rows); the verifier uses the rows of the nodes the plan kept (a prefix) and otherwise sample-then-match."""
        probs, self._probs = self._probs, {}
        return probs

    def _retry_due(self) -> bool:
        """A drafter that runs a model, quiet for ``_retry_after`` steps, drafts for real once (see RETRY_QUIET);
        below ``STALE_BATCH`` requests only, where one draft is a small share of the time."""
        if not self._retries or len(self._batch) >= STALE_BATCH:
            return False
        self._retry_wait += 1
        if self._retry_wait < self._retry_after:
            return False
        self._retry_wait, self._retrying = 0, True
        return True

    def _worth_drafting(self, reqs: list[DraftRequest], base: int, step: float, batch: int | None = None) -> bool:
        """The controller's re-check while speculation is off (there is news), spaced by its own measured cost so
        that it stays near ``CHECK_SHARE`` of the decoding time: the news waits, it is not lost."""
        if self._check_wait > 0:
            self._check_wait -= 1
            return False
        t0 = time.perf_counter()
        worth = self.controller.worth_drafting([(r.seq_id, r.max_draft) for r in reqs], base,
                                               self.draft_seconds_ema, self._decode_seqs, batch)
        if step > 0:
            self._check_wait = min(math.ceil((time.perf_counter() - t0) / (CHECK_SHARE * step)) - 1, CHECK_WAIT)
        self._news = worth            # worth it: the news stands (asked again next quiet step, if this draft fails)
        if worth:
            self._value = self.controller.last_probe_gain     # the running average starts from what it predicted
        return worth

    def _propose_shadows(self, reqs: list[DraftRequest], step: float) -> None:
        """Shadow drafts for as many requests as the credit pays for (each quiet step earns ``QUIET_SHARE`` of
        its time; a shadow draft spends what it measured): the longest-waiting requests first, each at most every
        ``shadow_gap`` steps. A drafter that runs a model, or many requests at a large batch, so costs ~2% of the
        decoding time however expensive one draft is (at 5%, EAGLE's shadows at batch 16 plus its catch-up cost
        ~9% of a run where it never drafted), and a model drafter whose retries keep failing less: the share is
        divided as its retries' wait grows (RETRY_QUIET), back to whole once drafting pays."""
        self._steps += 1
        # a model drafter whose retries keep failing spends as much less on shadows as its retries wait longer
        share = QUIET_SHARE * (RETRY_QUIET / self._retry_after if self._retries else 1.0)
        earned = share * step * self._potential(reqs)
        self._shadow_credit = min(self._shadow_credit + earned, SHADOW_BANK * earned)
        after = self._shadow_after
        need = [r for r in reqs if r.seq_id not in self._shadow and after.get(r.seq_id, 0) <= self._steps]
        if not need or self._shadow_credit <= 0.0:
            return
        n = 1 if self._shadow_cost is None else max(1, int(self._shadow_credit / self._shadow_cost))
        if n < len(need):
            need = sorted(need, key=lambda r: after.get(r.seq_id, -1))[:n]     # never shadowed, then the oldest
        drafts, dt, costly = self._draft(need)
        if len(need) == len(reqs):      # a whole drafting step's worth (at batch 1, always): it prices drafting
            self._time_drafting(dt)
        dt += costly + self._backlog_seconds
        self.num_shadow_proposals += 1
        self._shadow_credit -= dt
        per = dt / len(need)
        self._shadow_cost = per if self._shadow_cost is None else 0.7 * self._shadow_cost + 0.3 * per
        for r, d in zip(need, drafts):
            self.controller.note(r.seq_id, d.score, d.confidence)   # what the probe of worth_drafting goes by
            if d.tokens:
                self._shadow[r.seq_id] = (DraftTree.of(d.tokens, d.parents), len(r.token_ids), _claim(d), d.score)

    def _potential(self, reqs: list[DraftRequest]) -> float:
        """What finding good drafts could be worth in this step, in [0, 1], by which the shadows' share is scaled:
        the gain in tokens per second of this decode-only step if every request's longest draft were accepted,
        over plain decoding (capped at 1; 1 in a step with prefill chunks, whose drafts are priced in time). A
        compute-bound step (batch 64 on the CPU: a verified token costs nearly what a decoded one does, so perfect
        drafts would gain ~15%) buys few shadows; a GPU step, flat in its tokens, the whole share."""
        base = self._step_shape[1]
        if self._decode_seqs is None or base <= 0 or not reqs:
            return 1.0
        room = [r.max_draft for r in reqs]
        key = (self._decode_seqs, base, sum(room), max(room))
        memo = self._potential_memo                    # (it changes slowly: priced again every 8 quiet steps)
        if memo is not None and memo[0] == key and self._steps - memo[1] < 8:
            return memo[2]
        ctl = self.controller                          # (both steps predicted, not the quiet step's measured time)
        best = ctl.step_seconds(base + sum(room), self._decode_seqs, 1 + max(room))
        plain = ctl.step_seconds(base, self._decode_seqs)
        value = 1.0 if plain <= 0.0 else min(1.0, max(0.0, (base + sum(room)) * plain / (best * base) - 1.0))
        self._potential_memo = (key, self._steps, value)
        return value

    def _score_shadow(self, seq: "Sequence", given_up: bool = False) -> None:
        """Resolve a shadow draft once the committed tokens decide it: a mismatch, or every level matched. One
        ``given_up`` before that (a real draft replaces it, or the request ended) still counts what it has shown:
        the tokens that matched so far, deeper ones unknown. (A shadow resolves at its first mismatch while one
        that keeps matching waits, so dropping pending ones unscored kept only the failures: with every request
        shadowed, the controller learned that depth 2 was never accepted.)"""
        tree, start, claim, score = self._shadow[seq.seq_id]
        truth = seq.token_ids[start:]
        accepted = tree.accepted_length(truth)
        if accepted < len(truth) or accepted >= tree.depth:
            del self._shadow[seq.seq_id]
            self._shadow_after[seq.seq_id] = self._steps + self.shadow_gap
            self.controller.observe(seq.seq_id, len(tree), accepted, claim, score)
            self._news = True
        elif given_up:
            del self._shadow[seq.seq_id]
            if accepted:
                self.controller.observe(seq.seq_id, accepted, accepted, score=score)

    def observe(self, seq: "Sequence", num_drafted: int, num_accepted: int, topk: Seq | None) -> None:
        """A step's outcome for a decoding sequence, also the one that finished in it: the controller learns from
        it (a request that finishes by accepting its drafts is the best news a draft can bring; leaving it out, at
        batch 64 with 16-token answers, the record kept mostly the drafts that failed); the drafter only while
        the sequence goes on."""
        self._step_drafted += num_drafted
        if self.controller is not None:
            self.controller.observe(seq.seq_id, num_drafted, num_accepted)
            if num_drafted == 0 and seq.seq_id in self._shadow:
                self._score_shadow(seq)
        if not seq.is_finished:
            self.drafter.observe(seq.seq_id, seq.token_ids, num_accepted, topk)

    def observe_step(self, num_tokens: int, seconds: float, graph: tuple[int, int] | None = None,
                     emitted: int = 0, decodes=...) -> None:
        """A step's wall time from before drafting to its commit; the drafter's own time in it is taken out (the
        controller charges drafting apart), the rest (scheduling drafts, verifying them) is the step's cost.
        ``graph``: the CUDA graph bucket the step replayed, if any; ``emitted``: the tokens it committed (the
        guard compares whole steps, drafting included, per emitted token); ``decodes``: the plan's sequences if
        it held decodes only, else None (omitted: what was expected before scheduling). A step of the kind that
        was expected is priced as expected (the drafting requests' count); one of the other kind as what it was
        (waiting prompts the pool could not admit leave a step expected to hold prompt chunks decode-only), and the
        guard, which decided for the step it expected, does not judge it."""
        if decodes is ... or (decodes is None) == (self._decode_seqs is None):
            decodes = self._decode_seqs
        else:
            self._decode_seqs = None
        if self.controller is not None:
            self.controller.step_time.observe(num_tokens, max(seconds - self._step_draft_seconds, 1e-9), graph,
                                              decodes)
            if decodes is not None and not self._step_drafted and graph is None:
                self._plain_step = (decodes, max(seconds - self._step_draft_seconds, 1e-9))
        if self.guard is not None and self._decode_seqs is not None and not self._warming_up:
            mode = "bare" if self._guard_bare else "spec" if self._step_drafted else "quiet"
            self.guard.record(self._decode_seqs, mode, seconds, emitted)
        self._decode_seqs, self._guard_bare, self._step_drafted, self._decided = None, False, 0, False
        self._warming_up = False
        self._step_draft_seconds = 0.0

    def finish(self, seq: "Sequence") -> None:
        self.drafter.finish(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        if self.guard is not None:
            self.guard.request_ended()
        if seq.seq_id in self._shadow:
            self._score_shadow(seq, given_up=True)
        self._shadow_after.pop(seq.seq_id, None)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)


def _claim(draft) -> list[float] | None:
    """What a calibrated draft's confidences claim: each node's path probability, best first."""
    return [float(c) for c in draft.confidence] if draft.confidence else None
