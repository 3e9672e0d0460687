"""How many draft tokens to verify, per request and for the batch: speculate only while it raises tokens per second.

Each step the controller chooses the total number m of draft tokens to verify (0 is plain decoding) and who gets
them, maximising expected emitted tokens per second:

    goodput(m) = (B + sum of the m most valuable draft tokens) / (T(base + m) + drafting time if m > 0)

where B is one bonus token per decoding request and ``base`` the tokens the step computes anyway.

- **Cost, measured, not assumed** (:class:`StepTimeModel`): the engine reports every step's wall time, token
  count and, for a decode-only step, its number of sequences. Times are kept per token-count bucket (exact counts
  up to 32, then ~12% wide buckets) as the median of the last few steps, on one curve for steps with prefill
  chunks and one per batch size for decode-only steps (92 tokens as a prompt chunk and a few decodes cost what 64
  decodes do; 64 decodes with 28 draft tokens cost far more), so a CPU whose cost grows with every token, a GPU
  that is flat until a knee, the jump from a 1-token to a multi-token forward, and garbage-collection outliers are
  all what they really are. Between observed buckets T is interpolated, beyond them extrapolated, and made
  non-decreasing in m. The engine's start-up probe (forwards of 1-64 tokens over an empty cache, shaped as
  verifications) is kept apart as the curves' *shape* (:meth:`StepTimeModel.mark_prior`): real steps cost more
  than the probe's (their tokens attend to long contexts, the batch's rows are scattered), so where no real step
  of a size was seen, T follows the probe scaled by what real steps cost at the nearest sizes, an extra token at
  most ``MARGINAL_CAP`` times the probe's. Mixed naively, a real 16-token step next to the probe's cheaper
  17..64-token points made extra tokens look free (the curve is flattened to stay non-decreasing), and
  speculation at batch 16 ran below plain decoding. A plain step at a batch size last timed before new requests
  came in is timed again before a modest gain is trusted, from ``STALE_BATCH`` on before any gain, and there a
  plain step never timed is stale once every step seen at that batch size predates the new requests
  (:meth:`StepTimeModel.stale`); there, too, once the new requests have steps of their own, only those price the
  batch size (:meth:`StepTimeModel._fresh`: the previous requests' cheap speculating steps beside a fresh, dearer
  plain step priced drafts at nothing).
- **Graph steps cost their shape, not their token count**: a step replayed from a CUDA graph runs the bucket
  (sequences, tokens per sequence) that holds it, so verifying 1 draft token costs what verifying k costs, and
  the 1-token decode bucket is another kernel. Those steps are timed per bucket (:class:`GraphTimes`), apart from
  the token-count curve; a bucket not yet seen costs its replay time at start-up plus the host's share measured on
  the nearest bucket seen. The controller asks the runner which bucket a step of m draft tokens would run, so on a
  GPU, once a verification graph is paid for, its rows are filled (interpolating the probe's eager 4- and 8-token
  forwards instead priced a 5-token verification at 2.5x the 4-token one on an H200, and the controller drafted 3
  where 4 ran 1.6x faster).
- **Value, learned per request** (SpecDec++-like): the j-th draft token is worth P(tokens 1..j accepted) =
  p1 * prod c(d), with p1 the first-token acceptance of drafts of that score over every request
  (:meth:`Controller.first_rate`: a table by the drafter's score, in tenths), times the request's own fast-decaying
  ratio of first tokens accepted to what the table expected of its drafts, and c(d) the conditional acceptance at
  depth d (the request's own, shrunk toward the global per-depth rate). A verified draft of k with a accepted says:
  depths 1..a accepted, depth a+1 rejected, deeper unknown (censored), so choosing short drafts never teaches the
  controller that long ones fail. A calibrated draft (spec/calibration.py) is valued by its own per-token
  probabilities instead, each scaled by how often claims at its rank came true over every request
  (:meth:`Controller.rank_rates`) and by the request's own accepted tokens over what those rates expected
  (:meth:`Controller._rho`; verified and shadow drafts).
- **Never slower than plain**: m > 0 only when its predicted goodput beats plain decoding's by ``min_gain`` plus
  ``risk`` times the relative extra step time it predicts;
  occasional exploration steps measure the cost of a draft size (or of plain decoding) that has not been observed
  recently, when the model says it is close, and a draft size priced only by old steps is verified once when,
  priced as if they were forgotten, it would be best (:meth:`Controller._retime`); per-request estimates decay
  fast (``decay``), so a request whose drafts stop being accepted loses its drafts within a few steps.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate, compress
from operator import gt, truediv
from typing import Any, Sequence

import numpy as np

STALE_GAIN = 1.5                 # a predicted gain below this waits for a fresh plain step (StepTimeModel.stale)
STALE_BATCH = 8
"""From this batch size on, any predicted gain waits for a fresh plain step, and a plain step never timed at the
batch size is stale: its cost is mostly attention over the batch's contexts, which change with every cohort of
requests (at batch 64 on the CPU a plain step priced at 400 ms from earlier requests' steps cost 180 ms, a gain
of 2.3x was predicted and 0.88x realized). Below it a step is mostly weights read once, and a large gain (copying
text at batch 1) is trusted at once rather than paying a plain step per new request."""
REALIZED_PRIOR = 8.0             # claimed tokens' worth of trust in calibrated claims over all ranks (reported)
REALIZED_DECAY = 0.99            # per verified draft: at batch 64 a few steps, at batch 1 ~100 drafts
REALIZED_MAX = 3.0
"""Most a rank's rate (:meth:`Controller.rank_rates`), and a request's own record (:meth:`Controller._rho`),
scale a draft's claims up by. A draft model's running product of its own top probabilities under-claims where it
agrees with the target (layer_skip on HumanEval: claims of 0.1-0.5 a token, 0.91 accepted); capped at 1, the
controller valued those drafts below their worth."""
REQUEST_PRIOR = 2.0              # expected tokens' worth of trust a request's own record starts from (Controller._rho)
RANK_PRIOR = 2.0                 # claimed tokens' worth of trust in a calibrated drafter's claims, per rank
SCORE_BUCKETS = 10               # the drafter's score, in tenths, keys the first-token acceptance table
SCORE_DECAY = 0.99               # per draft of a bucket: the table follows the workload over ~100 of its drafts
SCORE_PRIOR = 1.0                # drafts' worth of trust in the drafter's own score, per bucket
FIRST_PRIOR = 1.5
"""Expected first tokens' worth of trust a request's own ratio (accepted over what the table expected) starts from
(:meth:`Controller._row_values`)."""
_EXACT = 32                      # token counts up to this are buckets of their own
SMALL_BATCH = 8                  # up to this many requests the controller decides in plain Python (no numpy)
SMALL_PREDICT = 48               # up to this many token counts StepTimeModel.predict runs in plain Python
_RATIO = math.log(1.125)         # then ~12% wide buckets


def size_bucket(n: int) -> int:
    """A size's bucket: exact up to 32, then ~12% wide (step times per token count; the guard's batch sizes)."""
    return n if n <= _EXACT else _EXACT + 1 + int(math.log(n / _EXACT) / _RATIO)


@dataclass
class _Bucket:
    obs: deque = field(default_factory=lambda: deque(maxlen=5))     # (tokens, seconds), most recent last
    last_seen: int = 0
    _point: tuple[float, float, int] | None = None                  # point(), until obs change (add)

    def add(self, num_tokens: int, seconds: float, clear: bool = False) -> None:
        if clear:
            self.obs.clear()
        self.obs.append((num_tokens, seconds))
        self._point = None

    def point(self) -> tuple[float, float, int]:
        """(mean token count, median seconds, steps behind them)."""
        if self._point is None:
            ts = sorted(t for _, t in self.obs)
            self._point = (sum(n for n, _ in self.obs) / len(self.obs), ts[len(ts) // 2], len(self.obs))
        return self._point


class GraphTimes:
    """Seconds of steps replayed from a CUDA graph, per bucket (sequences, tokens per sequence): the median of the
    last few real steps, else the bucket's replay time at start-up (:meth:`set_prior`) plus the host's share (real
    minus replay) seen on the observed bucket of the nearest batch size."""

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self._obs: dict[tuple[int, int], deque] = {}
        self._seen: dict[tuple[int, int], int] = {}
        self._prior: dict[tuple[int, int], float] = {}
        self._memo: dict[tuple[int, int], float | None] = {}   # answers since the last change (asked every step)

    def set_prior(self, bucket: tuple[int, int], seconds: float) -> None:
        self._prior[bucket] = seconds
        self._memo.clear()

    def observe(self, bucket: tuple[int, int], seconds: float, step: int) -> None:
        self._memo.clear()
        d = self._obs.get(bucket)
        if d is None:
            d = self._obs[bucket] = deque(maxlen=self.window)
        d.append(seconds)
        self._seen[bucket] = step

    def last_seen(self, bucket: tuple[int, int]) -> int | None:
        return self._seen.get(bucket)

    def __call__(self, bucket: tuple[int, int], since: int | None = None) -> float | None:
        """The bucket's predicted seconds; ``since``: from the steps seen since that step only (buckets last seen
        before it count as never seen)."""
        if since is not None:
            return self._predict(bucket, since)
        if bucket in self._memo:
            return self._memo[bucket]
        self._memo[bucket] = t = self._predict(bucket)
        return t

    def _predict(self, bucket: tuple[int, int], since: int = -1) -> float | None:
        d = self._obs.get(bucket)
        if d and self._seen[bucket] >= since:
            return sorted(d)[len(d) // 2]
        prior = self._prior.get(bucket)
        if prior is None:
            return None
        seen = [b for b in self._obs if b in self._prior and self._seen[b] >= since]
        if not seen:
            return prior
        near = min(seen, key=lambda b: (abs(b[0] - bucket[0]), abs(b[1] - bucket[1])))
        return prior + max(self._predict(near, since) - self._prior[near], 0.0)

    def forget(self, batch: int, before: int) -> None:
        """Drop the times of the buckets of ``batch`` sequences last seen before step ``before``."""
        for b in [b for b in self._obs if b[0] == batch and self._seen[b] < before]:
            del self._obs[b]
        self._memo.clear()


MIXED = "mixed"
"""The curve of steps that hold prefill chunks (or whose shape is not known)."""

DECODES = "decodes"
"""The curve of every decode-only step, whatever its batch: what a batch size with no steps of its own falls back to."""

MIXED_MARGIN = 0.25
"""In a step with prefill chunks, how much more than the time they add a draft's accepted tokens must be worth
(:meth:`Controller._choose_mixed`): the price of a token there is extrapolated from decode-only steps."""

MARGINAL_CAP = 3.0
"""Beyond the largest step seen on a curve, an extra token costs at most this many times the probe's extra token.
A real step's excess over the probe is mostly its batch's attention over long contexts, which draft tokens do not
multiply, but a draft token also pays what the probe leaves out (its row's sampling and verification, moving its
sequence into the padded verification batch). Measured on the CPU (SmolLM2-135M): forwards alone, 64 decodes over
100-300-token contexts cost 2.4x the probe's 64-token step and each draft token ~1.0x the probe's extra token (16
decodes over 50-1,000 tokens: 3.3x and ~2x); whole engine steps at batch 29-64, 2.3-4x. Holding the whole ratio
priced draft tokens at batch 64 up to 15x too high (speculation could never be tried there). With a cap of 2,
auto at batch 16 / 64 ran 1.08 / 0.97x and 0.99 / 1.00x of plain (single repeats down to 0.92); with 3, 1.03 / 0.99x
and 1.07 / 0.98x (down to 0.96), same command, same hour."""


class _Curve:
    """Step times by token count (buckets: exact up to 32, then ~12% wide), each the median of its last few steps."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.buckets: dict[int, _Bucket] = {}
        self.points: tuple | None = None        # (xs, ys, slope beyond, ratios to the prior, prior), when asked
        self.arrays: tuple | None = None        # the same as numpy arrays (StepTimeModel._predict_np), when asked
        self.fresh: tuple | None = None         # (bucket keys, the curve of only those), see StepTimeModel._fresh

    def observe(self, num_tokens: int, seconds: float, step: int, since: int = -1) -> None:
        """``since``: forget what the bucket saw before this step (the newest requests' arrival, large batches)."""
        key = size_bucket(num_tokens)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(deque(maxlen=self.window))
        b.add(num_tokens, seconds, clear=b.last_seen < since)
        b.last_seen = step
        self.points = self.arrays = self.fresh = None

    def seen_since(self, step: int) -> dict[int, _Bucket]:
        """The buckets last seen at or after ``step``."""
        return {k: b for k, b in self.buckets.items() if b.last_seen >= step}


class StepTimeModel:
    """T(n): seconds for a step that computes n tokens (see the module doc), kept apart for steps with prefill
    chunks and, for decode-only steps, per batch size (``num_seqs``): a 92-token step of a few sequences and a long
    prompt chunk says little about 64 decodes with 28 draft tokens (at batch 64 on the CPU one token-count curve
    priced such steps at ~0.6 s when they cost 0.7-1.1 s, and speculation lost 8-16%). ``c0``/``c1``: the line's
    prior."""

    def __init__(self, c0: float = 1e-3, c1: float = 1e-5, decay: float = 0.98, window: int = 5) -> None:
        self.c0, self.c1, self.decay, self.window = c0, c1, decay, window
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._curves: dict[object, _Curve] = {}
        self.num_observed = 0
        self.last_mixed = 0                  # the step count at the last step with prefill chunks
        self._prior: tuple[list[float], list[float], float] | None = None    # (xs, ys, slope beyond): the shape
        self._prior_np: tuple[np.ndarray, np.ndarray, float] | None = None  # the same as arrays
        self.graphs = GraphTimes(window)     # steps replayed from CUDA graphs: timed per bucket, not per token

    def mark_prior(self) -> None:
        """Keep what has been observed so far (the start-up probe) as the shape of the curves, not as measurements
        (see :meth:`predict`). Does nothing when nothing was observed, or when a prior is already set."""
        if self._prior is not None or not self._curves:
            return
        pooled = _Curve(self.window)
        for c in self._curves.values():
            for k, b in c.buckets.items():
                into = pooled.buckets.setdefault(k, _Bucket(deque(maxlen=self.window)))
                for n, t in b.obs:
                    into.add(n, t)
        xs, ys, slope = self._points(pooled)[:3]
        self._prior = (xs, list(accumulate(ys, max)), slope)
        self._prior_np = (np.array(xs), np.array(self._prior[1]), slope)
        self._curves = {}

    def _prior_at(self, ns: np.ndarray) -> np.ndarray:
        xs, ys, slope = self._prior_np
        out = np.interp(ns, xs, ys)
        if len(ns) and ns[-1] > xs[-1]:
            out = out + np.maximum(ns - xs[-1], 0.0) * slope
        return out

    def _prior_at_list(self, ns: list[float]) -> list[float]:
        """:meth:`_prior_at` in plain Python, the same numbers."""
        xs, ys, slope = self._prior
        out = [_interp(n, xs, ys) for n in ns]
        if ns and ns[-1] > xs[-1]:
            out = [o + max(n - xs[-1], 0.0) * slope for o, n in zip(out, ns)]
        return out

    def observe(self, num_tokens: int, seconds: float, graph: tuple[int, int] | None = None,
                num_seqs: int | None = None) -> None:
        """A step of ``num_tokens`` tokens took ``seconds``; ``graph``: the CUDA graph bucket it replayed, if any
        (its time goes to :attr:`graphs`, not to the token-count curves); ``num_seqs``: its sequences when it
        held decodes only (None: it held prefill chunks)."""
        if num_tokens <= 0 or not seconds > 0.0:
            return
        self.num_observed += 1
        if graph is not None:
            self.graphs.observe(graph, seconds, self.num_observed)
            return
        d = self.decay
        self._sw = d * self._sw + 1
        self._sx = d * self._sx + num_tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + num_tokens * num_tokens
        self._sxy = d * self._sxy + num_tokens * seconds
        var = self._sw * self._sxx - self._sx ** 2
        if var > 1e-9 * max(self._sw * self._sxx, 1.0):
            slope = (self._sw * self._sxy - self._sx * self._sy) / var
            self.c1 = max(slope, 1e-9)
            self.c0 = max((self._sy - self.c1 * self._sx) / self._sw, 1e-6)
        if num_seqs is None:
            self.last_mixed = self.num_observed
        keys = (MIXED,) if num_seqs is None else (DECODES, size_bucket(num_seqs))
        for key in keys:
            c = self._curves.get(key)
            if c is None:
                c = self._curves[key] = _Curve(self.window)
            own = num_seqs is not None and num_seqs >= STALE_BATCH and key != DECODES    # (see _fresh)
            c.observe(num_tokens, seconds, self.num_observed, self.last_mixed if own else -1)

    def _curve(self, num_seqs: int | None) -> _Curve | None:
        """The curve that prices a step: its batch size's (decode-only steps), else every decode-only step's, else
        the mixed steps'; for a mixed step, the mixed steps', else the decode-only steps'."""
        keys = (MIXED, DECODES) if num_seqs is None else (size_bucket(num_seqs), DECODES, MIXED)
        for key in keys:
            c = self._curves.get(key)
            if c is not None:
                return c
        return None

    def steps_since_seen(self, num_tokens: int, graph: tuple[int, int] | None = None,
                         num_seqs: int | None = None) -> int:
        """Steps since a step of this size (its bucket on the curve that prices it, or its graph bucket) was last
        observed; a large number if never."""
        if graph is not None:
            seen = self.graphs.last_seen(graph)
            return self.num_observed - seen if seen is not None else 1 << 30
        b = self._bucket(num_tokens, num_seqs)
        return self.num_observed - b.last_seen if b is not None else 1 << 30

    def stale(self, num_tokens: int, num_seqs: int, after: int = 8) -> bool:
        """Is the decode-only step of this size at this batch size known only from before the last step with
        prefill chunks, more than ``after`` steps ago? (New requests came in since: their contexts, hence
        the step's cost, may differ. A controller that speculates never times a plain step otherwise: at batch 64 on
        the CPU a plain step priced at 254 ms by the previous requests' steps cost 165 ms with the next ones', and
        speculation that lost 22% looked like a gain.)"""
        b = self._bucket(num_tokens, num_seqs)
        if b is None:   # never timed at this batch size: priced by its other steps, all from earlier requests?
            c = self._curves.get(size_bucket(num_seqs)) if num_seqs >= STALE_BATCH else None
            return c is not None and not self._since_newest(c)
        return b.last_seen < self.last_mixed and self.num_observed - b.last_seen > after

    def _since_newest(self, c: _Curve) -> dict[int, _Bucket]:
        """The buckets of a curve seen since the newest requests came in (the last step with prefill chunks)."""
        return {k: b for k, b in c.buckets.items() if b.last_seen > self.last_mixed}

    def _fresh(self, c: _Curve | None, num_seqs: int | None) -> _Curve | None:
        """From ``STALE_BATCH`` on, a batch size's own curve with only the steps seen since the newest requests
        came in (their contexts set a step's cost), once it has any (until then, all of it: the controller times a
        plain step first, see :meth:`stale`).
        At batch 64 on the CPU, draft tokens priced by the previous requests' speculating steps made the new
        requests' drafts look cheap: ~1.3 tokens per step realized at 0.91x of plain decoding."""
        if c is None or not num_seqs or num_seqs < STALE_BATCH or c is not self._curves.get(size_bucket(num_seqs)):
            return c
        keep = self._since_newest(c)
        if not keep or len(keep) == len(c.buckets):
            return c
        key = tuple(sorted(keep))
        if c.fresh is None or c.fresh[0] != key:       # (reset whenever the curve observes a step)
            fresh = _Curve(c.window)
            fresh.buckets = keep
            c.fresh = (key, fresh)
        return c.fresh[1]

    def _bucket(self, num_tokens: int, num_seqs: int | None) -> _Bucket | None:
        """The bucket of this size on the steps' own curve (their batch size's, or the mixed steps'), if seen."""
        c = self._curves.get(MIXED if num_seqs is None else size_bucket(num_seqs))
        return c.buckets.get(size_bucket(num_tokens)) if c is not None else None

    def _points(self, c: _Curve) -> tuple:
        """The curve's (xs, ys, slope beyond, ratios to the prior, prior at xs), as lists (kept until it observes
        a step)."""
        if c.points is None:
            pts = sorted(b.point() for b in c.buckets.values())
            xs = [p[0] for p in pts]
            ys = _monotone([p[1] for p in pts], [p[2] for p in pts])
            slope = self.c1             # beyond the largest observed size: the line, or the last segment if steeper
            if len(xs) > 1 and xs[-1] > xs[-2]:
                slope = max(slope, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            px = self._prior_at_list(xs) if self._prior is not None and xs else None
            c.points = (xs, ys, slope, [y / max(p, 1e-12) for y, p in zip(ys, px)] if px is not None else None, px)
        return c.points

    def forget(self, num_seqs: int | None, before: int) -> None:
        """Drop the buckets last seen before step ``before`` from the curve that prices steps of ``num_seqs``
        sequences: sizes priced by old steps (a burst of load, other requests' contexts) are priced again by the
        newer ones and the probe's shape, and the next step of such a size is its only time."""
        c = self._curve(num_seqs)
        if c is not None:
            c.buckets = c.seen_since(before)
            c.points = c.arrays = c.fresh = None

    def predict(self, ns: np.ndarray, num_seqs: int | None = None, since: int | None = None) -> np.ndarray:
        """T at each token count of ``ns``, an increasing numpy array, for a step of ``num_seqs`` decoding
        sequences (None: a step with prefill chunks); the result is non-decreasing. ``since``: as if the steps
        seen before that step had been forgotten (:meth:`forget`)."""
        if len(ns) <= SMALL_PREDICT:
            return np.array(self.predict_list(np.asarray(ns, dtype=np.float64).tolist(), num_seqs, since))
        return self._predict_np(np.asarray(ns, dtype=np.float64), self._pricing_curve(num_seqs, since))

    def predict_list(self, ns: Sequence[int], num_seqs: int | None = None, since: int | None = None) -> list[float]:
        """:meth:`predict` as a list (what the controller's decision works on): up to ``SMALL_PREDICT`` counts in
        plain Python, more through numpy."""
        c = self._pricing_curve(num_seqs, since)
        if len(ns) <= SMALL_PREDICT:
            return self._predict_list([float(n) for n in ns], *self._curve_points(c))
        arr = np.arange(ns.start, ns.stop, dtype=np.float64) if isinstance(ns, range) else \
            np.asarray(ns, dtype=np.float64)
        return self._predict_np(arr, c).tolist()

    def _pricing_curve(self, num_seqs: int | None, since: int | None) -> _Curve | None:
        """The curve that prices a step of ``num_seqs`` sequences (:meth:`_curve`, :meth:`_fresh`), of only its
        steps seen since ``since`` when given."""
        c = self._fresh(self._curve(num_seqs), num_seqs)
        if since is not None and c is not None:
            keep = c.seen_since(since)
            if len(keep) < len(c.buckets):
                c = _Curve(c.window)
                c.buckets = keep
        return c

    def _curve_points(self, c: _Curve | None) -> tuple:
        return self._points(c) if c is not None else ([], [], self.c1, None, None)

    def _predict_np(self, ns: np.ndarray, c: _Curve | None) -> np.ndarray:
        """:meth:`predict` for many token counts, in numpy."""
        if c is None:
            xs, ys, slope, ratios, px = np.empty(0), np.empty(0), self.c1, None, None
        else:
            if c.arrays is None:
                c.arrays = tuple(np.asarray(v, dtype=np.float64) if isinstance(v, list) else v
                                 for v in self._points(c))
            xs, ys, slope, ratios, px = c.arrays
        if self._prior is not None:
            out = self._prior_at(ns)
            if len(xs):
                # below the steps seen: the probe scaled by the first step's ratio; between them: their chord plus
                # the probe's own departure from its chord (a jump at 2 tokens), scaled; beyond: the last step plus
                # the probe's extra cost, scaled (both scales at most MARGINAL_CAP)
                below, beyond = ns < xs[0], ns > xs[-1]
                mid = ~(below | beyond)
                kappa = np.minimum(np.interp(ns[mid], xs, ratios), MARGINAL_CAP)
                out[mid] = np.interp(ns[mid], xs, ys) + kappa * (out[mid] - np.interp(ns[mid], xs, px))
                out[beyond] = ys[-1] + min(ratios[-1], MARGINAL_CAP) * (out[beyond] - px[-1])
                out[below] *= ratios[0]
            return np.maximum.accumulate(out)
        if len(xs) == 0:
            return self.c0 + self.c1 * ns
        out = np.interp(ns, xs, ys)
        if ns[-1] > xs[-1]:
            out += np.maximum(ns - xs[-1], 0.0) * slope
        if ns[0] < xs[0]:
            out = np.maximum(out - np.maximum(xs[0] - ns, 0.0) * self.c1, 0.5 * ys[0])
        return np.maximum.accumulate(out)

    def _predict_list(self, ns: list[float], xs: list[float], ys: list[float], slope: float,
                      ratios: list[float] | None, px: list[float] | None) -> list[float]:
        """:meth:`predict` in plain Python for a few token counts, the same numbers as its numpy path (tested equal
        to the bit): numpy's per-call overhead on arrays of ~5 counts made a prediction ~120 us a step at batch 1 on
        the 2-core VM, ~1.5% of the step."""
        if self._prior is not None:
            out = self._prior_at_list(ns)
            if xs:
                cap_last = min(ratios[-1], MARGINAL_CAP)
                for i, n in enumerate(ns):      # (see the numpy path for what each region does)
                    if n < xs[0]:
                        out[i] *= ratios[0]
                    elif n > xs[-1]:
                        out[i] = ys[-1] + cap_last * (out[i] - px[-1])
                    else:
                        kappa = min(_interp(n, xs, ratios), MARGINAL_CAP)
                        out[i] = _interp(n, xs, ys) + kappa * (out[i] - _interp(n, xs, px))
            return list(accumulate(out, max))
        if not xs:
            return [self.c0 + self.c1 * n for n in ns]
        out = [_interp(n, xs, ys) for n in ns]
        if ns[-1] > xs[-1]:
            out = [o + max(n - xs[-1], 0.0) * slope for o, n in zip(out, ns)]
        if ns[0] < xs[0]:
            out = [max(o - max(xs[0] - n, 0.0) * self.c1, 0.5 * ys[0]) for o, n in zip(out, ns)]
        return list(accumulate(out, max))

    def __call__(self, num_tokens: int, num_seqs: int | None = None) -> float:
        return float(self.predict([num_tokens], num_seqs)[0])


def _charged(cost: list[float], draft_seconds: float) -> list[float]:
    """Step costs with the drafting time added to every count of draft tokens above none."""
    return cost[:1] + [c + draft_seconds for c in cost[1:]]


def _beats_plain(expected: list[float], cost: list[float], plain: float, lift: float,
                 risk: float) -> tuple[list[float], int]:
    """(goodput of each draft count, the best count whose goodput beats plain decoding's by ``lift`` plus ``risk``
    times the relative extra step time it predicts, or 0). Many counts (a large batch's drafts) go through numpy,
    the same arithmetic: in plain Python 641 counts took ~100 us more."""
    if len(cost) > SMALL_PREDICT:
        e, c = np.asarray(expected), np.asarray(cost)
        g = e / c
        ok = g > plain * (lift + risk * (c / c[0] - 1.0))
        ok[0] = False
        return g.tolist(), int(np.argmax(np.where(ok, g, -np.inf))) if ok.any() else 0
    c0 = cost[0]
    g = list(map(truediv, expected, cost))
    ok = list(map(gt, g, [plain * (lift + risk * (x / c0 - 1.0)) for x in cost]))
    ok[0] = False
    return g, _best_passing(g, ok)


def _best_passing(score: list[float], ok: list[bool]) -> int:
    """The first index of the best score among those that pass (``np.argmax(np.where(ok, score, -inf))``), or 0
    when none passes."""
    return max(compress(range(len(ok)), ok), key=score.__getitem__, default=0)


def _argmax(xs: list[float]) -> int:
    """The first index of the largest value (``np.argmax``)."""
    return xs.index(max(xs))


def _judge(passing, charged: list[float], cost: list[float], sunk: bool) -> tuple[list[float], bool, int]:
    """(scores, whether drafting pays, the best passing count or 0) for ``passing(costs)`` -> (scores, the best
    passing count or 0; count 0 never passes), judged on the ``charged`` costs (drafting included). When drafting
    does not pay but the drafts are in hand (``sunk``), their time is spent: keep what they gain now, judged without
    it (at batch 1 on the CPU an EAGLE draft is ~12% of a step; charged again, a draft that came out modest was
    thrown away with its few likely tokens). Where drafting pays, the charged choice stands: spread over more
    tokens, the drafting time that recurs every step is what makes longer drafts worth verifying."""
    score, top = passing(charged)
    pays = top > 0
    if sunk and not pays:
        score, top = passing(cost)
    return score, pays, top


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """``np.interp(x, xs, ys)`` for one point in plain Python, the same number (numpy's formula and edge cases:
    the end values outside ``xs``, a knot's own value on it)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x) - 1
    if xs[j] == x:
        return ys[j]
    return (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (x - xs[j]) + ys[j]


def _monotone(ys: list[float], ws: list[int]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in weighted least squares (pool adjacent violators; weights:
    the steps behind each point). A bucket priced by one slow step then pools with the better-known bucket above
    it instead of lifting it: at batch 1 on the CPU, where 1 to 5 tokens cost within ~5% of each other and a
    step's noise is larger, one slow verification step of 2 tokens had priced every draft of 2-4 tokens 25% above
    plain decoding, and a draft that is not chosen is never timed again."""
    blocks: list[list[float]] = []           # [weighted mean, weight, points]
    for y, w in zip(ys, ws):
        blocks.append([float(y), float(max(w, 1)), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            y2, w2, n2 = blocks.pop()
            y1, w1, n1 = blocks[-1]
            blocks[-1] = [(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [b[0] for b in blocks for _ in range(b[2])]


def _score_bucket(score: float) -> tuple[float, int]:
    """A drafter's score clipped to [0.02, 0.98], and its bucket of the first-token table (tenths)."""
    sc = min(max(float(score), 0.02), 0.98)
    return sc, min(int(sc * SCORE_BUCKETS), SCORE_BUCKETS - 1)


@dataclass
class _Acceptance:
    first_acc: float = 0.0       # decayed count of drafts whose first token was accepted
    first_exp: float = 0.0       # ... and of what the score table expected of them (Controller.first_rate)
    fail_run: int = 0            # consecutive drafts whose first token was rejected
    cont_acc: float = 0.0        # decayed count of deeper tokens accepted after an accepted parent
    cont_n: float = 0.0
    claims_exp: float = 0.0      # decayed tokens its calibrated drafts were expected to get (claims scaled by rank)
    claims_met: float = 0.0      # ... and got (Controller._rho)
    surprise: float = 1.0        # P(its current run of failed calibrated drafts) under their first claims


_ZERO = _Acceptance()             # a request with no history yet (read only)


class Controller:
    """See the module doc. ``max_draft``: most draft tokens per request; ``decay``: per-step forgetting of a
    request's own acceptance; ``min_gain``: how much better than plain decoding a draft must be predicted to be;
    ``graph_bucket(num_seqs, tokens_per_seq)``: the CUDA graph bucket the runner would replay for such a step, or
    None (it runs eagerly), from ``CudaGraphs.shape_bucket``."""

    def __init__(self, max_draft: int, step_time: StepTimeModel | None = None, decay: float = 0.8,
                 first_decay: float = 0.85, run_alarm: float = 0.1, min_gain: float = 0.03, global_decay: float = 0.98,
                 explore_every: int = 32, explore_tolerance: float = 0.1, stale_after: int = 128,
                 graph_bucket=None) -> None:
        self.max_draft = max_draft
        self.graph_bucket = graph_bucket
        self.step_time = step_time or StepTimeModel()
        self.step_time.mark_prior()      # what it holds now (the start-up probe) is the curve's shape
        self.run_alarm = run_alarm
        self.decay, self.first_decay, self.min_gain = decay, first_decay, min_gain
        self.global_decay = global_decay
        self.explore_every, self.explore_tolerance, self.stale_after = explore_every, explore_tolerance, stale_after
        self._retime_at = stale_after     # the step from which old prices may be checked again (:meth:`_retime`)
        self._retime_wait = stale_after   # ... after a re-timing: doubles each time, until drafting keeps paying
        self._paying_since: int | None = None   # the step since which drafts have been chosen on their merit
        self._acc: dict[int, _Acceptance] = {}
        self._score: dict[int, float] = {}
        self._confidence: dict[int, Any] = {}   # the latest draft's calibrated confidences (:meth:`note`)
        # global: first-token acceptance per score bucket (first_rate), and conditional acceptance per depth
        # (index d = depth, d >= 2)
        self._g_first_acc = [0.0] * SCORE_BUCKETS
        self._g_first_n = [0.0] * SCORE_BUCKETS
        self._drafted_score: dict[int, float] = {}    # the score of each request's verified draft (observe)
        self._g_depth_acc = np.zeros(max(max_draft, 1) + 2)
        self._g_depth_n = np.zeros(max(max_draft, 1) + 2)
        self.num_calls = 0
        self.last_choice: dict = {}       # the last decision, for benchmarks and debugging
        self.last_probe_gain = 1.0        # the gain the last quiet re-check predicted (:meth:`worth_drafting`)
        # calibrated drafts: what their kept tokens claimed (raw confidences, per request until verified), the
        # decayed tokens claimed and accepted at each rank of a draft, whose ratio scales later claims at that rank
        # (rank_rates), and over all ranks (:attr:`realized`, reported)
        self._claims: dict[int, list[float]] = {}
        self._claimed = self._realized = 0.0
        self._rank_claimed = [0.0] * max(max_draft, 1)
        self._rank_met = [0.0] * max(max_draft, 1)
        self._rank_memo: list[float] | None = None

    # -- acceptance ------------------------------------------------------------------------------------------------
    def alpha(self, seq_id: int, score: float = 0.5) -> float:
        """P(the first draft token is accepted) for this request, given the drafter's score for the draft."""
        return self._row_values((seq_id, 1, score), [])[0]

    def _depth_rates(self, K: int) -> list[float]:
        """The global conditional acceptance at depths 2..K (shrunk toward 0.6), shared by every row."""
        return [(float(self._g_depth_acc[d]) + 0.6) / (float(self._g_depth_n[d]) + 1.0) for d in range(2, K + 1)]

    def first_rate(self, score: float) -> float:
        """P(a draft's first token is accepted | the drafter's score for it), over every request: the drafts of
        the score's bucket so far, shrunk toward the score itself by ``SCORE_PRIOR`` drafts. A drafter's score
        says how much evidence is behind a draft (n-gram: the match length; on the real model's outputs a 1-token
        match's first token was accepted 9-11% of the time, a 4-token one's 85%), which one rate per request
        threw away: a request's record then priced its next weak match like the strong ones before it."""
        sc, b = _score_bucket(score)
        return (self._g_first_acc[b] + SCORE_PRIOR * sc) / (self._g_first_n[b] + SCORE_PRIOR)

    def _row_values(self, p: tuple, g: list[float]) -> list[float]:
        """One row of :meth:`_values` in plain Python, in the same order of operations (the small-batch path is
        tested equal to the numpy one): P(draft tokens 1..j all accepted), j = 1..1 + len(g), for a proposal
        (seq_id, offer, score[, confidence]); ``g``: :meth:`_depth_rates`."""
        a = self._acc.get(p[0]) or _ZERO
        v = min(0.98, self.first_rate(p[2]) * ((a.first_acc + FIRST_PRIOR) / (a.first_exp + FIRST_PRIOR)))
        # a run of misses that this estimate makes unlikely (P < run_alarm) says the regime has changed: scale
        # the estimate down by how unlikely the run is, so a request whose drafts stop matching backs off at once
        v *= min(1.0, (1.0 - v) ** float(a.fail_run) / self.run_alarm)
        row = [v]
        for gd in g:
            v *= (a.cont_acc + gd) / (a.cont_n + 1.0)
            row.append(v)
        if len(p) > 3 and p[3]:
            row[:len(p[3][:len(row)])] = self._claimed_values(a, p[3][:len(row)])
        return row

    def _values(self, proposals: list[tuple], K: int) -> np.ndarray:
        """[R, K]: P(draft tokens 1..j of request r all accepted), j = 1..K (:meth:`_row_values` vectorised:
        :meth:`alpha` times the conditional acceptance at each depth, the request's own shrunk toward the global
        per-depth rate). A draft that carries calibrated per-token probabilities (a 4th element, best first:
        spec/calibration.py) is valued by them instead."""
        own = [self._acc.get(p[0]) or _ZERO for p in proposals]
        stats = np.array([(a.first_acc, a.first_exp, a.fail_run, a.cont_acc, a.cont_n) for a in own]).reshape(-1, 5)
        rates = np.array([self.first_rate(p[2]) for p in proposals], dtype=np.float64)
        p1 = np.minimum(0.98, rates * ((stats[:, 0] + FIRST_PRIOR) / (stats[:, 1] + FIRST_PRIOR)))
        p1 *= np.minimum(1.0, (1.0 - p1) ** stats[:, 2] / self.run_alarm)
        values = np.empty((len(proposals), K))
        values[:, 0] = p1
        if K > 1:
            d = np.arange(2, K + 1)
            g = (self._g_depth_acc[d] + 0.6) / (self._g_depth_n[d] + 1.0)
            values[:, 1:] = (stats[:, 3:4] + g[None, :]) / (stats[:, 4:5] + 1.0)
        values = np.cumprod(values, axis=1)
        for r, p in enumerate(proposals):
            if len(p) > 3 and p[3]:
                values[r, :len(p[3][:K])] = self._claimed_values(own[r], p[3][:K])
        return values

    def _claimed_values(self, a: _Acceptance, conf) -> list[float]:
        """A calibrated draft's token values: each claim scaled by its rank's rate (:meth:`rank_rates`) and the
        request's own record (:meth:`_rho`), each at most 1, and, after a run of verified drafts whose first token
        failed, by how unlikely their claims made that run (below ``run_alarm``), as for uncalibrated drafts (the
        ratio's prior alone left a request whose every draft failed a first token worth ~0.3, and it drafted one
        token a step for good; a run of failures its drafts' own low claims foresaw changes nothing)."""
        rho = self._rho(a)
        g = self.rank_rates()
        top = len(g) - 1
        vals = [min(1.0, float(c) * (g[min(j, top)] * rho)) for j, c in enumerate(conf)]
        alarm = min(1.0, a.surprise / self.run_alarm)
        return [v * alarm for v in vals] if alarm < 1.0 else vals

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int, claimed: list[float] | None = None,
                score: float | None = None) -> None:
        """A draft of ``num_drafted`` tokens of which ``num_accepted`` were accepted (verified, or scored in the
        shadow of a plain step): depths 1..a accepted, a+1 rejected (if drafted), deeper unknown. ``claimed``,
        ``score``: a shadow draft's claims (its confidences, best first) and score; a verified one's were kept when
        it was chosen."""
        claims = self._claims.pop(seq_id, None)      # (a draft the step did not verify is claimed no more)
        kept_score = self._drafted_score.pop(seq_id, None)
        if num_drafted <= 0:
            return
        if score is None:
            score = kept_score if kept_score is not None else self._score.get(seq_id, 0.5)
        if claims is not None:
            claimed = claims[:num_drafted]
        a = self._acc.setdefault(seq_id, _Acceptance())
        d, gd, fd = self.decay, self.global_decay, self.first_decay
        if claimed:
            # shadows count too: a controller that stopped speculating would otherwise never see its claims
            # come true again (at batch 1 speculation then stayed off for good on GSM8K and HumanEval)
            g = self.rank_rates()
            top = len(g) - 1
            expected = sum(float(c) * g[min(j, top)] for j, c in enumerate(claimed))
            rd = REALIZED_DECAY
            self._claimed = rd * self._claimed + sum(claimed)
            self._realized = rd * self._realized + num_accepted
            for j, c in enumerate(claimed):      # (a tree's nodes best first: rank j is met when j < accepted)
                r = min(j, top)
                self._rank_claimed[r] = rd * self._rank_claimed[r] + float(c)
                self._rank_met[r] = rd * self._rank_met[r] + (1.0 if j < num_accepted else 0.0)
            self._rank_memo = None
            a.claims_exp, a.claims_met = d * a.claims_exp + expected, d * a.claims_met + num_accepted
        first = 1.0 if num_accepted > 0 else 0.0
        a.first_acc, a.first_exp = fd * a.first_acc + first, fd * a.first_exp + self.first_rate(score)
        a.fail_run = 0 if first else a.fail_run + 1
        if first:
            a.surprise = 1.0
        elif claims:                # how unlikely the run of failures is, by what each draft claimed
            a.surprise *= 1.0 - min(1.0, claims[0])
        cont_trials = max(0, min(num_accepted + 1, num_drafted) - 1)   # depths 2..min(a+1, k)
        cont_acc = max(0, num_accepted - 1)
        a.cont_acc, a.cont_n = d * a.cont_acc + cont_acc, d * a.cont_n + cont_trials
        b = _score_bucket(score)[1]
        self._g_first_acc[b] = SCORE_DECAY * self._g_first_acc[b] + first
        self._g_first_n[b] = SCORE_DECAY * self._g_first_n[b] + 1.0
        if cont_trials:
            self._g_depth_acc *= gd
            self._g_depth_n *= gd
            top = min(len(self._g_depth_n) - 1, 1 + cont_trials)
            self._g_depth_n[2:top + 1] += 1.0
            self._g_depth_acc[2:min(top, num_accepted) + 1] += 1.0

    def _note(self, proposals: list[tuple]) -> None:
        for p in proposals:
            self.note(p[0], p[2], p[3] if len(p) > 3 else None)

    def note(self, seq_id: int, score: float, confidence: Any = None) -> None:
        """The drafter's latest draft for a request (a real or a shadow one): its score and calibrated
        confidences, which :meth:`worth_drafting` values the request by."""
        self._score[seq_id] = score
        if confidence:
            self._confidence[seq_id] = confidence
        else:
            self._confidence.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        self._acc.pop(seq_id, None)
        self._drafted_score.pop(seq_id, None)
        self._score.pop(seq_id, None)
        self._confidence.pop(seq_id, None)
        self._claims.pop(seq_id, None)

    @property
    def realized(self) -> float:
        """Accepted tokens per token claimed by calibrated drafts over all ranks (decayed, shrunk toward 1 by
        REALIZED_PRIOR claimed tokens; within [0.1, REALIZED_MAX]), for reports: claims are scaled rank by rank
        (:meth:`rank_rates`)."""
        return min(REALIZED_MAX, max(0.1, (self._realized + REALIZED_PRIOR) / (self._claimed + REALIZED_PRIOR)))

    def rank_rates(self) -> list[float]:
        """Per rank j of a calibrated draft's tokens (best first), accepted over claimed tokens at that rank over
        every request (decayed per draft by REALIZED_DECAY, shrunk by RANK_PRIOR claimed tokens toward the rate of
        the rank before it, the first toward 1; within [0.1, REALIZED_MAX]): what a claim at that rank is scaled
        by. (Shrunk toward 1, ranks that short drafts never reach kept their raw claims, and a drafter that
        under-claims never drafted deeper than where its scale was learnt.) A fresh drafter's calibration trusts
        its own guesses, which at batch 64 on the CPU claimed 1.3-2x the tokens then accepted, where a verified
        token costs ~40% of a plain token's share of the step: each such step lost ~10%; and the error grows along
        the draft (auto on the default model's outputs: the first-ranked claims came true 0.7-1.2 times, the
        fourth-ranked 0.0-0.4 times on summaries, grounded QA and math), which one scale for all ranks could not
        follow. A draft model's confidences can err the other way (REALIZED_MAX)."""
        if self._rank_memo is None:
            rates, prior = [], 1.0
            for m, c in zip(self._rank_met, self._rank_claimed):
                prior = min(REALIZED_MAX, max(0.1, (m + RANK_PRIOR * prior) / (c + RANK_PRIOR)))
                rates.append(prior)
            self._rank_memo = rates
        return self._rank_memo

    def _rho(self, a: _Acceptance) -> float:
        """What a request's calibrated claims are scaled by, beyond their ranks' rates: its own accepted tokens
        over what those rates expected of its drafts (decayed per draft by ``decay``; ``REQUEST_PRIOR`` expected
        tokens' worth of trust to start with). The global ratio alone kept valuing a request's drafts after they
        stopped coming true: at batch 1 on the CPU, one document whose drafts all matched, then a second whose
        drafts claimed ~2 tokens a step and got ~0.3, drafted 4 tokens a step on it at 0.82x of plain decoding (a
        verification of 5 tokens costs ~1.8 plain steps there)."""
        return min(REALIZED_MAX, max(0.05, (a.claims_met + REQUEST_PRIOR) / (a.claims_exp + REQUEST_PRIOR)))

    def _remember_claims(self, proposals: list[tuple], keep: list[int]) -> None:
        """The kept drafts' claims and scores, which :meth:`observe` learns from once they are verified."""
        for p, k in zip(proposals, keep):
            if k:
                self._drafted_score[p[0]] = float(p[2])
                if len(p) > 3 and p[3]:
                    self._claims[p[0]] = [float(c) for c in p[3][:k]]

    # -- the decision ----------------------------------------------------------------------------------------------
    def draft_lengths(self, proposals: list[tuple], other_tokens: int, draft_seconds: float = 0.0,
                      num_seqs: int | None = None, trees: bool = False, record: bool = True,
                      sunk: bool = False, batch: int | None = None) -> list[int]:
        """proposals: (seq_id, draft length on offer, drafter score[, per-token confidence]) per decoding request
        (the confidence, when given, values the draft's tokens: see :meth:`_values`); other_tokens: tokens the
        step computes anyway (one per decode, plus prefill chunks); draft_seconds: what drafting costs per step;
        num_seqs: the step's sequences when it holds decodes only (a shape a CUDA graph may run), else None;
        trees: the drafts are token trees (their steps run eagerly: priced by tokens, never by a graph bucket);
        record: remember the proposals (:meth:`note`) and the kept tokens' claims (False: a probe); sunk: the
        drafts are already made: where drafting does not pay with their time, keep what pays without it (that
        time is spent), and say in ``last_choice["pays"]`` whether it paid with it (whether to draft next step);
        batch: with prefill chunks (``num_seqs`` None), the sequences that will decode together once the prompts
        are in, which prices an accepted token (:meth:`_choose_mixed`; None: the decoding requests).
        Returns how many draft tokens to keep for each."""
        self.num_calls += 1
        R = len(proposals)
        if R <= SMALL_BATCH and self.small_fast_path:
            return self._draft_lengths_small(proposals, other_tokens, draft_seconds, num_seqs, trees, record, sunk,
                                             batch)
        keep = [0] * R
        lengths = np.array([min(p[1], self.max_draft) for p in proposals], dtype=np.int64)
        K = int(lengths.max(initial=0))
        if K <= 0:
            return keep
        if record:
            self._note(proposals)
        values = self._values(proposals, K)
        values[np.arange(K)[None, :] >= lengths[:, None]] = -1.0          # beyond what is on offer
        flat = values.ravel()
        M = int(lengths.sum())
        order = np.argsort(-flat, kind="stable")[:M]
        expected = float(R) + np.concatenate(([0.0], np.cumsum(flat[order])))
        chosen = self._choose(expected.tolist(), order.tolist(), K, other_tokens, draft_seconds, num_seqs, trees,
                              sunk, batch, probe=not record)
        if chosen:
            counts = np.bincount(order[:chosen] // K, minlength=R)
            keep = counts.tolist()
            if record:
                self._remember_claims(proposals, keep)
        return keep

    risk = 0.2
    """Share of a draft's predicted extra step time added to the gain it must show (see :meth:`_choose`). At batch
    64 on the CPU drafts that doubled the step were predicted to gain 1.2-1.3x and realized 0.9-1.0x; at batch 1,
    where four draft tokens add ~15% to a step, the bar rises by ~3%."""

    small_fast_path = True
    """Up to ``SMALL_BATCH`` requests: values and order in plain Python, the same numbers as the numpy path (tested
    equal to the bit); numpy's per-call overhead made that path ~90-120 us a call for one request here and
    130-450 us on an H200's host, against a 0.4 ms GPU step. The choice itself (:meth:`_choose`) works on lists
    at every batch size: its arrays are the M + 1 draft counts (5 at batch 1), where numpy's ~20 calls on them cost
    ~100 us a step inside the engine at batch 1 on the 2-core VM."""

    def _draft_lengths_small(self, proposals: list[tuple], other_tokens: int, draft_seconds: float,
                             num_seqs: int | None, trees: bool, record: bool, sunk: bool = False,
                             batch: int | None = None) -> list[int]:
        """:meth:`draft_lengths` for a few proposals: :meth:`_row_values` row by row, and the same stable order of
        the (request, depth) values as the numpy path."""
        R = len(proposals)
        lengths = [min(p[1], self.max_draft) for p in proposals]
        K = max(lengths, default=0)
        if K <= 0:
            return [0] * R
        g = self._depth_rates(K)
        flat: list[float] = []
        if record:
            self._note(proposals)
        for p, L in zip(proposals, lengths):
            row = self._row_values(p, g)
            row[L:] = [-1.0] * (K - L)                            # beyond what is on offer
            flat += row
        order = sorted(range(R * K), key=lambda i: -flat[i])[:sum(lengths)]   # stable, as np.argsort's
        expected, total = [float(R)], 0.0
        for i in order:
            total += flat[i]
            expected.append(R + total)
        chosen = self._choose(expected, order, K, other_tokens, draft_seconds, num_seqs, trees, sunk, batch,
                              probe=not record)
        keep = [0] * R
        for i in order[:chosen]:
            keep[i // K] += 1
        if chosen and record:
            self._remember_claims(proposals, keep)
        return keep

    def _choose(self, expected: list[float], order: list[int], K: int, other_tokens: int, draft_seconds: float,
                num_seqs: int | None, trees: bool = False, sunk: bool = False, batch: int | None = None,
                probe: bool = False) -> int:
        """How many of the ``order``ed draft tokens to keep: the count m whose step has the best expected tokens
        per second (``expected[m]`` over its predicted cost, drafting included unless ``sunk``), if that beats
        plain decoding by ``min_gain``; in a step with prefill chunks, see :meth:`_choose_mixed`."""
        cost, graphs = self._costs(other_tokens, order, K, num_seqs, trees)
        charged = _charged(cost, draft_seconds)
        if num_seqs is None and other_tokens > expected[0]:
            return self._choose_mixed(expected, cost, charged, draft_seconds, sunk, batch)
        plain = expected[0] / cost[0]

        def passing(c: list[float]) -> tuple[list[float], int]:
            # a draft must beat plain decoding by min_gain plus a share of the extra step time it predicts: the
            # cost and acceptance models err in proportion to what they extrapolate
            return _beats_plain(expected, c, plain, 1.0 + self.min_gain, self.risk)
        goodput, pays, chosen = _judge(passing, charged, cost, sunk)
        best = _argmax(goodput)
        explored = False
        if chosen and num_seqs and graphs is None \
                and (goodput[chosen] < plain * STALE_GAIN or num_seqs >= STALE_BATCH) \
                and self.step_time.stale(other_tokens, num_seqs):
            chosen, explored = 0, True      # time plain decoding at this batch again before trusting its price
        elif chosen == 0 and num_seqs and num_seqs < STALE_BATCH and graphs is None and len(goodput) > 1:
            chosen = self._thin(goodput, other_tokens, num_seqs)
            explored = chosen > 0
        if not explored and self.explore_every and self.num_calls % self.explore_every == 0:
            chosen, explored = self._explore(chosen, best, goodput, other_tokens, graphs, num_seqs)
        if not explored and num_seqs and self.step_time.num_observed >= self._retime_at:
            retimed = self._retime(expected, order, K, other_tokens, draft_seconds, num_seqs, trees, chosen, cost,
                                   plain, probe)
            if retimed is not None:
                chosen, cost, goodput = retimed
                explored = True
        if not probe:
            self._note_merit(chosen > 0 and not explored, explored)
        self.last_choice = {"tokens": chosen, "best": best, "gain": float(goodput[chosen] / plain),
                            "explored": explored, "realized": self.realized, "pays": pays if sunk else chosen > 0,
                            # drafts in hand: what this step is predicted to deliver against plain decoding, its
                            # drafting time included (below 1 when drafting did not pay, whatever is kept)
                            "value": float(expected[chosen] / (cost[chosen] + draft_seconds) / plain) if sunk
                            else None}
        return chosen

    def _choose_mixed(self, expected: list[float], cost: list[float], charged: list[float], draft_seconds: float,
                      sunk: bool, batch: int | None = None) -> int:
        """:meth:`_choose` for a step that holds prefill chunks. Its tokens per second is the wrong yardstick there:
        the prompt tokens are work that must be done, not a loss, yet beside a long chunk they make any accepted draft
        token look nearly free (at batch 64 on the CPU drafts were verified in every 2,048-token prefill step,
        pushing as many prompt tokens to later steps). So in time: an accepted token is worth what its row costs in
        a decode-only step of the batch that will decode once the prompts are in, T(B) / B (the price the goodput
        rule itself gives a token there; B = ``batch``, at least the R decoding requests: 8 requests decoding among
        64 prompts will decode at 64, where a row costs a fraction of what it does at 8), and a draft pays when its
        expected tokens are worth ``MIXED_MARGIN`` more than the time it adds."""
        R = float(expected[0])
        B = max(int(R), batch or 0, 1)
        worth = self.step_seconds(B, B) / B           # (a CUDA graph bucket's time where one would run it)
        saved = [(e - R) * worth for e in expected]

        def passing(c: list[float]) -> tuple[list[float], int]:
            extra = [x - c[0] for x in c]
            ok = [sv > ex * (1.0 + MIXED_MARGIN) for sv, ex in zip(saved, extra)]
            ok[0] = False
            net = [sv - ex for sv, ex in zip(saved, extra)]
            return net, _best_passing(net, ok)
        net, pays, chosen = _judge(passing, charged, cost, sunk)
        # gain and value as time ratios: (the step's time + what its accepted tokens save later) over its time
        self.last_choice = {"tokens": chosen, "best": _argmax(net), "explored": False,
                            "gain": float((cost[0] + saved[chosen]) / charged[chosen]), "realized": self.realized,
                            "pays": pays if sunk else chosen > 0,
                            "value": float((cost[0] + saved[chosen]) / (cost[chosen] + draft_seconds)) if sunk
                            else None}
        return chosen

    def token_prices(self, batch: int, other_tokens: int, num_seqs: int | None = None) -> tuple[float, float]:
        """(what one accepted draft token saves in this step, what verifying one more token adds to it), in seconds:
        its row's share of a decode-only step at the batch that decodes, T(B) / B (as :meth:`_choose_mixed` prices
        it), and T(other_tokens + 1) - T(other_tokens) for this step (a model drafter's stopping rule,
        spec/drafter.py ``depth_pays``)."""
        B = max(int(batch), 1)
        extra = self.step_time(other_tokens + 1, num_seqs) - self.step_time(other_tokens, num_seqs)
        return self.step_seconds(B, B) / B, max(extra, 0.0)

    def step_seconds(self, tokens: int, num_seqs: int | None = None, per_seq: int = 1) -> float:
        """Predicted seconds of a step of ``tokens`` tokens; of its graph bucket when it holds ``num_seqs``
        decoding sequences of at most ``per_seq`` tokens each and a graph would run it."""
        t = self._graph_seconds(num_seqs, per_seq)[1] if self.graph_bucket is not None and num_seqs else None
        return t if t is not None else self.step_time(tokens, num_seqs)

    def _graph_seconds(self, num_seqs: int, per_seq: int,
                       since: int | None = None) -> tuple[tuple[int, int] | None, float | None]:
        """(the graph bucket a step of ``num_seqs`` sequences of at most ``per_seq`` tokens replays, its predicted
        seconds); (None, None) when it runs eagerly, a time of None when the bucket has neither prior nor steps.
        ``since``: priced by the steps seen since that step only."""
        bucket = self.graph_bucket(num_seqs, per_seq)
        return bucket, (self.step_time.graphs(bucket, since) if bucket is not None else None)

    def _costs(self, other_tokens: int, order: list[int], K: int, num_seqs: int | None, trees: bool = False,
               since: int | None = None):
        """Predicted seconds of the step with the m = 0..M most valuable draft tokens, and m -> the graph bucket
        that step would replay (None: eager), or None for no graphs. The m-th token of the greedy order is at depth
        order % K + 1 of its draft, so the step's longest sequence after m tokens is 1 + the running maximum of
        those depths: non-decreasing in m, so each bucket prices one contiguous run of m. (In a step that prompts
        fill, the scheduler gives draft tokens the budget first and pushes as many prompt tokens to a later step:
        T(other_tokens + m) still prices them, with ``other_tokens`` counting the prompt work the step faces.)
        ``since``: priced by the steps seen since that step only."""
        M = len(order)
        cost = self.step_time.predict_list(range(other_tokens, other_tokens + M + 1), num_seqs, since)
        if self.graph_bucket is None or not num_seqs or trees:
            return cost, None
        q, deepest = [1], 0
        for o in order:
            deepest = max(deepest, o % K + 1)
            q.append(1 + deepest)
        buckets = {}
        lo = 0
        while lo <= M:
            depth = q[lo]
            hi = bisect.bisect_right(q, depth)
            buckets[depth], t = self._graph_seconds(num_seqs, depth, since)
            if t is not None:
                cost[lo:hi] = [t] * (hi - lo)
            lo = hi
        return cost, (lambda m: buckets[q[m]])

    EVIDENCE = 3
    """Below ``STALE_BATCH``, a draft size whose price rests on fewer steps than this is tried when it is predicted
    within ``explore_tolerance`` of plain decoding (:meth:`_thin`)."""

    def _thin(self, goodput: list[float], base: int, num_seqs: int) -> int:
        """The best draft size, if its price rests on fewer than ``EVIDENCE`` steps and it is predicted close to
        plain decoding: one slow step would otherwise keep a size from being timed again (a draft that is not
        chosen is not timed), and at small batches a step's noise is larger than what drafts add to it. Each size
        is tried at most ``EVIDENCE`` times per batch size (below ``STALE_BATCH`` its steps are kept across
        requests), so this costs a few steps per process."""
        best = 1 + _argmax(goodput[1:])
        if goodput[best] < goodput[0] * (1.0 - self.explore_tolerance):
            return 0
        b = self.step_time._bucket(base + best, num_seqs)
        return best if b is None or len(b.obs) < self.EVIDENCE else 0

    def _explore(self, chosen: int, best: int, goodput: list[float], base: int, graphs,
                 num_seqs: int | None) -> tuple[int, bool]:
        """Measure what the model has not seen lately, when it is predicted to be close: plain decoding while
        speculating, or the best draft size while not."""
        st = self.step_time
        graph = graphs or (lambda m: None)  # noqa: E731
        if chosen > 0 and st.steps_since_seen(base, graph(0), num_seqs) > self.stale_after:
            return 0, True
        if chosen == 0 and best == 0 and len(goodput) > 1:
            best = 1 + _argmax(goodput[1:])
        if chosen == 0 and best > 0 and goodput[best] >= goodput[0] * (1.0 - self.explore_tolerance) \
                and st.steps_since_seen(base + best, graph(best), num_seqs) > self.explore_every:
            return best, True
        return chosen, False

    RETIME_MAX = 2048
    """Most steps between two re-timings of old prices (:meth:`_retime`)."""

    def _retime(self, expected: list[float], order: list[int], K: int, other_tokens: int, draft_seconds: float,
                num_seqs: int, trees: bool, chosen: int, cost: list[float], plain: float, probe: bool):
        """Re-time a draft size priced by old steps: (its count, the costs, the goodputs) if one is due, else None.
        A size that is not chosen is not timed again, so a price set during a burst of load (six times the real
        cost on the first 40 verification steps) kept every draft off for good. Once every ``stale_after`` steps
        (the wait doubling after each re-timing, back to ``stale_after`` once drafts have paid on their merit for
        that long), the sizes are priced as if the steps older than ``stale_after`` were forgotten; if plain
        decoding's price rests on newer steps and another size is then best and within ``explore_tolerance`` of
        plain decoding, the old steps are forgotten and that size is verified: one step, that times it afresh."""
        st = self.step_time
        now = st.num_observed
        since = now - self.stale_after
        fresh, _ = self._costs(other_tokens, order, K, num_seqs, trees, since)
        if fresh[0] == cost[0] and fresh != cost:
            goodput = [e / c for e, c in zip(expected, _charged(fresh, draft_seconds))]
            m = 1 + _argmax(goodput[1:])
            if m != chosen and goodput[m] >= plain * (1.0 - self.explore_tolerance):
                if not probe:
                    st.forget(num_seqs, since)
                    bucket = self.graph_bucket(num_seqs, 1) if self.graph_bucket is not None else None
                    if bucket is not None:
                        st.graphs.forget(bucket[0], since)
                    self._retime_at = now + self._retime_wait
                    self._retime_wait = min(2 * self._retime_wait, self.RETIME_MAX)
                return m, fresh, goodput
        self._retime_at = now + self.stale_after      # nothing old worth a step: look again later
        return None

    def _note_merit(self, paid: bool, explored: bool) -> None:
        """Drafts chosen on their merit for ``stale_after`` steps running: re-timings wait ``stale_after`` again."""
        now = self.step_time.num_observed
        if paid:
            if self._paying_since is None:
                self._paying_since = now
            elif now - self._paying_since >= self.stale_after:
                self._retime_wait = self.stale_after
        elif not explored:
            self._paying_since = None

    def worth_drafting(self, offers: list[tuple[int, int]], other_tokens: int, draft_seconds: float = 0.0,
                       num_seqs: int | None = None, batch: int | None = None) -> bool:
        """Could any draft pay this step? offers: (seq_id, room). Values each request by its drafter's latest draft
        (:meth:`note`: its score, and its calibrated confidences when it had them); a cheap check that lets the
        speculator skip the drafter when speculation is off."""
        # (a probe valued by the score alone, while the drafts are valued by their confidences, said "worth it" on
        # every quiet step at batch 64 on the CPU, and every real draft then chose nothing)
        conf = self._confidence
        probe = [(sid, room, self._score.get(sid, 0.5)) if sid not in conf else
                 (sid, min(room, len(conf[sid])), self._score.get(sid, 0.5), conf[sid]) for sid, room in offers]
        calls, last = self.num_calls, self.last_choice
        keep = self.draft_lengths(probe, other_tokens, draft_seconds, num_seqs, record=False, batch=batch)
        self.last_probe_gain = self.last_choice.get("gain", 1.0)
        self.num_calls, self.last_choice = calls, last
        return any(keep) or (self.explore_every > 0 and (calls + 1) % self.explore_every == 0)
