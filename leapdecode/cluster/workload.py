"""What a serving cluster is asked to do: a request trace (arrival times, prompt and output lengths) and the
latency targets each request should meet.

A ``Workload`` is a description (arrival rate, length distributions, seed, number of requests); ``requests()``
turns it into the same list of ``SimRequest`` every time. The rate only scales the gaps between arrivals: the
random draws behind the gaps and the lengths do not depend on it, so the traces at two rates are the same requests
on a stretched clock (common random numbers). That keeps SLO attainment nearly monotone in the rate, which is what
the goodput search (simulator.goodput) bisects on.

Goodput follows DistServe (Zhong et al., OSDI'24): the highest request rate at which at least ``attainment`` (e.g.
90%) of the requests meet both the time-to-first-token (TTFT) and the time-per-output-token (TPOT) targets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np


# -- length distributions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fixed:
    """Every request has ``n`` tokens."""
    n: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, int(self.n), dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform in [lo, hi]."""
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=size)


@dataclass(frozen=True)
class LogNormal:
    """A lognormal of the given ``mean`` (the distribution's, not the log's) and log-space ``sigma``, rounded and
    clipped to [lo, hi]. Prompt and output lengths of chat traces are roughly lognormal (heavy right tail)."""
    mean: float
    sigma: float = 1.0
    lo: int = 1
    hi: int = 1 << 30

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size)), self.lo, self.hi).astype(np.int64)


Lengths = Fixed | Uniform | LogNormal


# -- requests, targets, workloads --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival: float          # seconds from the start of the trace
    prompt_len: int
    output_len: int         # tokens generated, the first one included (ignore_eos, max_tokens=output_len)
    index: int = 0          # position in the trace


@dataclass(frozen=True)
class SLO:
    """Latency targets: TTFT (arrival to first token) and TPOT (mean time per output token after the first), and
    the share of requests that must meet both for a rate to count as served."""
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be positive, got ttft_s={self.ttft_s!r}, tpot_s={self.tpot_s!r}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO.attainment must be in (0, 1], got {self.attainment!r}")

    def met(self, ttft: float, tpot: float) -> bool:
        return ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclass(frozen=True)
class Workload:
    """A request trace description. ``pairs``, when given, replaces the two distributions: request i has
    ``pairs[i % len(pairs)]`` as (prompt_len, output_len), in order (a recorded dataset's lengths).
    ``arrival``: "poisson" (exponential gaps of mean 1/rate) or "uniform" (gaps of exactly 1/rate)."""
    rate: float = 1.0
    input: Lengths = Fixed(512)
    output: Lengths = Fixed(128)
    num_requests: int = 200
    seed: int = 0
    arrival: str = "poisson"
    pairs: tuple[tuple[int, int], ...] | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"Workload.rate must be > 0 requests/s, got {self.rate!r}")
        if self.arrival not in ("poisson", "uniform"):
            raise ValueError(f"Workload.arrival must be 'poisson' or 'uniform', got {self.arrival!r}")
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"Workload.num_requests must be a positive integer, got {self.num_requests!r}")
        if self.pairs is not None:
            object.__setattr__(self, "pairs", tuple((int(a), int(b)) for a, b in self.pairs))
            if not self.pairs or any(a < 1 or b < 1 for a, b in self.pairs):
                raise ValueError("Workload.pairs must be a non-empty list of (prompt_len >= 1, output_len >= 1)")

    def at_rate(self, rate: float) -> "Workload":
        return replace(self, rate=rate)

    def lengths(self) -> list[tuple[int, int]]:
        """(prompt_len, output_len) of each request, independent of the rate."""
        n = self.num_requests
        if self.pairs is not None:
            return [self.pairs[i % len(self.pairs)] for i in range(n)]
        seeds = np.random.SeedSequence(self.seed).spawn(3)
        ins = self.input.sample(np.random.default_rng(seeds[1]), n)
        outs = self.output.sample(np.random.default_rng(seeds[2]), n)
        if ins.min() < 1 or outs.min() < 1:
            raise ValueError("length distributions must give lengths >= 1")
        return [(int(a), int(b)) for a, b in zip(ins, outs)]

    def requests(self) -> list[SimRequest]:
        """The trace: the first request arrives at 0."""
        n = self.num_requests
        if self.arrival == "uniform":
            gaps = np.ones(n)
        else:
            gaps = np.random.default_rng(np.random.SeedSequence(self.seed).spawn(3)[0]).exponential(1.0, n)
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps) / self.rate
        return [SimRequest(float(t), p, o, i) for i, (t, (p, o)) in enumerate(zip(arrivals, self.lengths()))]

    def mean_lengths(self) -> tuple[float, float]:
        ls = self.lengths()
        return sum(p for p, _ in ls) / len(ls), sum(o for _, o in ls) / len(ls)
