"""The last word on speculation: measured tokens per second with the drafter against without it.

The controller (spec/controller.py) decides from models of cost and acceptance; a cost it does not model (the
host's per-sequence work around drafts on a GPU whose step is all host time, a drafter's bookkeeping, shadow drafts,
collections that land in later steps) can make it speculate, or keep drafting shadows, where plain decoding is
faster. The guard measures what each mode really delivers, seconds per emitted token over whole steps (drafting
included), per batch size:

- ``bare``: the drafter is not asked at all (plain decoding);
- ``spec``: drafts were verified this step;
- ``quiet``: the drafter was asked (shadow drafts, the controller's check) but nothing was verified.

Once the drafter's modes have a few samples at a batch size, and every ``refresh`` steps after, it runs a short
window of bare steps there, so the bare rate is current; when the measured rate of the drafter's steps (spec and
quiet together: the quiet ones pay for drafts the speculating ones verify) is worse than bare by more than
``margin``, the drafter is switched off at that batch size for a cool-down that doubles each time this repeats
there (up to ``max_cooldown``; the drafter's evidence decays per step, so the cool-down ages it) and resets when
speculation wins again there: a server whose load swings keeps
speculating at batch 1 after losing at batch 64. Below ``STALE_BATCH`` a veto ends with the request it was earned
on (:meth:`ThroughputGuard.request_ended`), and a bare rate measured more than ``stale`` steps ago is measured again
before it vetoes anything.
Steps with prefill chunks are not compared (their cost is the prompt's, not the mode's). While the drafter is off,
an engine with ``async_scheduling`` overlaps its steps as plain decoding does (engine/engine.py): those bare steps
are timed from step to step, so speculation is measured against plain decoding at its best, not against a
synchronous step that no plain engine would run.

On the H200 the embedded model's plain decoding at batch 64 is ~2 ms a step of host work, and each of n-gram,
suffix and draft-model speculation, adaptive, ran at 0.18-0.78x of it: the guard is what holds the controller's
promise of never being slower than plain decoding where its models are wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from leapdecode.spec.controller import STALE_BATCH, size_bucket

MODES = ("bare", "spec", "quiet")
DRAFTER = "drafter"   # spec and quiet steps together: what running the drafter delivers, judged against bare
QUICK = 4             # samples that settle a clear loss (and start the first bare window)
CLEAR_LOSS = 1.5      # a mode this much slower than bare is vetoed on QUICK samples, not min_samples


@dataclass
class _Rate:
    seconds: float = 0.0      # decayed sums over this mode's steps: a ratio of sums, not a mean of ratios (a
    tokens: float = 0.0       # spec step emits 1 to k + 1 tokens; one bad step must not outweigh ten good ones)
    count: int = 0
    fresh: int = 0            # samples since the last veto
    at: int = 0               # the guard's step count at the last sample

    @property
    def spt(self) -> float:
        """Seconds per emitted token."""
        return self.seconds / self.tokens if self.tokens > 0 else 0.0


@dataclass
class _Batch:
    rates: dict[str, _Rate] = field(default_factory=lambda: {m: _Rate() for m in (*MODES, DRAFTER)})
    window_at: int | None = None     # the step the last bare window started
    veto_until: int = 0              # the drafter is off at this batch size until this step
    cooldown: int = 0                # the next veto's length here (starts at the guard's base)


class ThroughputGuard:
    def __init__(self, margin: float = 0.08, window: int = 8, refresh: int = 256, cooldown: int = 64,
                 max_cooldown: int = 4096, min_samples: int = 16, decay: float = 0.97, stale: int = 64) -> None:
        """``margin``: how much slower a mode must measure than bare to be vetoed. The controller makes the fine
        choices; the guard is for clear losses: a speculative step emits 1 to k + 1 tokens, so over ~15 steps a
        ratio of sums still varies by several percent, and a smaller margin vetoed speculation that paid 1.1x.
        ``stale``: a bare rate last measured more than this many steps ago is measured again (a bare window now)
        before it vetoes anything: on a shared machine a step's time drifts by more than ``margin`` within
        minutes (plain batch-1 steps of 18 and 25 ms in one half hour on the 2-core VM), and a veto then compared
        the drafter's steps with a machine that was no longer there."""
        self.margin, self.window, self.refresh, self.stale = margin, window, refresh, stale
        self.base_cooldown, self.max_cooldown = cooldown, max_cooldown
        self.min_samples, self.decay = min_samples, decay
        self.steps = 0
        self.veto_until = 0              # every batch size vetoed until this step (set from outside: benchmarks)
        self.num_vetoes = 0
        self._bare_left = 0
        self._batches: dict[int, _Batch] = {}

    def _batch(self, num_seqs: int) -> _Batch:
        key = size_bucket(num_seqs)
        b = self._batches.get(key)
        if b is None:
            b = self._batches[key] = _Batch(cooldown=self.base_cooldown)
        return b

    def _until(self, num_seqs: int) -> int:
        b = self._batches.get(size_bucket(num_seqs))
        return max(self.veto_until, b.veto_until if b is not None else 0)

    def vetoed(self, num_seqs: int) -> bool:
        """Is the drafter off at this batch size now? (A veto earned at batch 64 says nothing about batch 1.)"""
        return self.steps < self._until(num_seqs)

    def off(self, num_seqs: int) -> bool:
        """Will the next step of ``num_seqs`` sequences run without the drafter whatever it holds (a veto there, or
        a bare window running)? The engine may then run it as plain decoding runs, overlapped."""
        return self.steps + 1 < self._until(num_seqs) or self._bare_left > 0

    @property
    def cooldown(self) -> int:
        """The longest next veto over the batch sizes seen (reports)."""
        return max((b.cooldown for b in self._batches.values()), default=self.base_cooldown)

    def bare(self, num_seqs: int) -> bool:
        """Called once per step that has decodes: must this step run without the drafter?"""
        self.steps += 1
        if self.steps < self._until(num_seqs):
            return True
        if self._bare_left > 0:
            self._bare_left -= 1
            return True
        b = self._batch(num_seqs)
        measured = b.rates["spec"].count + b.rates["quiet"].count >= QUICK   # something to compare
        if measured and (b.window_at is None or self.steps - b.window_at > self.refresh):
            b.window_at = self.steps
            self._bare_left = self.window - 1
            return True
        return False

    def request_ended(self) -> None:
        """A request ended. Below ``STALE_BATCH`` a step costs about the same whatever the requests (mostly the
        weights, read once), and what the drafter gains is the requests' text: its record there is about text
        that is gone, so vetoes there are lifted and the drafter's rates forgotten (the bare rate, the machine's,
        stays). At batch 1 on the CPU a veto earned on chat, where EAGLE's drafts cost ~5% more than they gained,
        had run the next requests (math, code: 1.3-1.4x with EAGLE) without the drafter for 64, then 128
        steps. From ``STALE_BATCH`` on, a step's cost is the batch's, and vetoes hold their cool-down."""
        for key, b in self._batches.items():
            if key < STALE_BATCH:
                b.veto_until = min(b.veto_until, self.steps)
                for m in ("spec", "quiet", DRAFTER):
                    b.rates[m] = _Rate()

    def record(self, num_seqs: int, mode: str, seconds: float, emitted: int) -> None:
        """A decode-only step of ``num_seqs`` sequences ran in ``mode`` for ``seconds`` (drafting included) and
        emitted ``emitted`` tokens."""
        if emitted <= 0 or not seconds > 0.0:
            return
        b = self._batch(num_seqs)
        for key in (mode,) if mode == "bare" else (mode, DRAFTER):
            r = b.rates[key]
            # bare steps are sampled in windows: their rate decays per sample. The drafter's decays per step
            # since its last sample, so a veto's cool-down ages the evidence that earned it (by 0.97 ** 64 = 0.14
            # after the first): a burst of load on a few verification steps (six times their cost) otherwise
            # outweighed every later good step, and each cool-down ended in a veto on the next two steps
            kept = self.decay if key == "bare" or r.count == 0 else self.decay ** max(self.steps - r.at, 1)
            r.seconds = kept * r.seconds + seconds
            r.tokens = kept * r.tokens + emitted
            r.count += 1
            r.fresh += 1
            r.at = self.steps
        bare = b.rates["bare"]
        if mode == "bare" or b.rates[DRAFTER].fresh < 2 or bare.count < QUICK:
            return
        # the drafter's steps are judged together: quiet steps pay for the drafts that speculating steps verify
        # (a draft the controller then declines, a shadow, the first draft of a prompt), and judged apart they
        # vetoed EAGLE at batch 1 on the CPU (quiet 24.6 ms a token, bare 20.8) where its steps together ran at
        # 19.7 (speculating ones at 15.7)
        d = b.rates[DRAFTER]
        worse = d.spt / bare.spt if bare.spt > 0 else 1.0
        if worse > 1.0 + self.margin and (d.count >= self.min_samples or worse > CLEAR_LOSS and d.count >= QUICK):
            if self.steps - bare.at > self.stale:
                b.window_at = None                 # the next step at this size starts a bare window, which
                b.rates["bare"] = _Rate()          # alone sets the bare rate the next comparison uses
                return
            # the evidence stays (decaying): after the cool-down two more bad steps veto again, while a real
            # change (the text starts to copy) outweighs it within ~10 steps
            b.veto_until = self.steps + b.cooldown
            b.cooldown = min(2 * b.cooldown, self.max_cooldown)
            self.num_vetoes += 1
            for m in ("spec", "quiet", DRAFTER):
                b.rates[m].fresh = 0
        elif mode == "spec" and d.spt < bare.spt * (1.0 - self.margin):
            b.cooldown = self.base_cooldown
