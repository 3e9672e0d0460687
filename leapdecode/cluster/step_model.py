"""How long one engine step takes, as a function of its shape: the cost model the cluster simulator runs on.

A step's **shape** (``StepShape``) is what its cost depends on: prefill tokens (and how many sequences they belong
to), decoding sequences (one new token each), the KV tokens the step's attention reads, and the query-key pairs it
computes. ``StepShape.of_plan`` reads it off a real ``StepPlan``, so the simulator prices exactly the steps the
engine's scheduler plans.

Two cost models give seconds for a shape:

- ``StepCost``, fitted: t = c0 + c_token * tokens + c_seq * seqs + c_kv * kv_tokens + c_pair * attn_pairs, by
  least squares (non-negative, relative error) from measured (shape, seconds) samples. ``measure(llm)`` collects
  such samples by timing whole ``Engine.step`` calls of a real engine on this machine over prefill and decode
  shapes (so host work, sampling and detokenization are in the cost, as they are in a served request's latency).
- ``RooflineCost``, analytic, for hardware that is not here (``roofline(model, hardware, tp)``): a step costs the
  larger of its compute time (matmul FLOPs 2 * params per token, attention 4 * heads * head_dim per pair and layer,
  at ``mfu`` of the peak) and its memory time (the weights once plus the KV read and written, at ``mbu`` of the
  HBM bandwidth), plus a fixed host overhead, plus, under tensor parallelism, two ring all-reduces per layer of the
  step's hidden states. TP divides the compute, the weights and the KV heads by the degree. Decode steps come out
  bandwidth-bound, long prefills compute-bound, as they are.

Why not ``leapdecode.spec.controller.StepTimeModel``: that one is the speculation controller's *online* estimate
of T(n), the time of a step of n tokens, learned from the steps the engine has just run, per token count only, to
decide how many draft tokens to verify next step. The simulator needs an *offline* cost for step shapes it has
never run (other batch mixes, other context lengths, other hardware and TP degrees), so it models the shape
itself. Neither replaces the other.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

import numpy as np

if TYPE_CHECKING:
    from leapdecode.engine.step import StepPlan
    from leapdecode.llm import LLM


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0     # tokens of prompt (or recompute) chunks
    prefill_seqs: int = 0       # sequences those chunks belong to
    decode_seqs: int = 0        # sequences computing exactly one token
    kv_tokens: int = 0          # KV tokens the step's attention reads (each sequence: start + new tokens)
    attn_pairs: int = 0         # query-key pairs (causal): n * start + n * (n + 1) / 2 per sequence

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int]]) -> "StepShape":
        """From (start, new tokens) per scheduled sequence; a one-token chunk is a decode."""
        pt = ps = ds = kv = pairs = 0
        for start, n in chunks:
            if n == 1:
                ds += 1
            else:
                pt += n
                ps += 1
            kv += start + n
            pairs += n * start + n * (n + 1) // 2
        return cls(pt, ps, ds, kv, pairs)

    @classmethod
    def of_plan(cls, plan: "StepPlan") -> "StepShape":
        return cls.of_chunks((c.start, c.num_new_tokens) for c in plan.seqs)

    @classmethod
    def prefill(cls, n: int, start: int = 0, seqs: int = 1) -> "StepShape":
        """``seqs`` chunks of ``n`` tokens each, after ``start`` computed tokens."""
        return cls.of_chunks([(start, n)] * seqs)

    @classmethod
    def decode(cls, batch: int, context: int) -> "StepShape":
        """``batch`` decoding sequences of ``context`` tokens each (the new one included)."""
        return cls.of_chunks([(context - 1, 1)] * batch)


class StepTime(Protocol):
    def __call__(self, shape: StepShape) -> float: ...


# -- fitted -----------------------------------------------------------------------------------------------------
TERMS = ("c0", "c_token", "c_seq", "c_kv", "c_pair")


@dataclass(frozen=True)
class StepCost:
    """t = c0 + c_token * tokens + c_seq * seqs + c_kv * kv_tokens + c_pair * attn_pairs (seconds)."""
    c0: float = 0.0
    c_token: float = 0.0
    c_seq: float = 0.0
    c_kv: float = 0.0
    c_pair: float = 0.0

    def __call__(self, s: StepShape) -> float:
        return (self.c0 + self.c_token * s.tokens + self.c_seq * s.seqs + self.c_kv * s.kv_tokens
                + self.c_pair * s.attn_pairs)

    @staticmethod
    def features(s: StepShape) -> list[float]:
        return [1.0, s.tokens, s.seqs, s.kv_tokens, s.attn_pairs]

    @classmethod
    def fit(cls, samples: Iterable[tuple[StepShape, float]], terms: Iterable[str] = TERMS) -> "StepCost":
        """Least squares on relative error with every coefficient >= 0 (a term whose free fit goes negative is
        dropped and the rest refitted, until none is). ``terms``: the coefficients allowed to be non-zero."""
        samples = list(samples)
        if not samples:
            raise ValueError("StepCost.fit needs at least one (shape, seconds) sample")
        allowed = [TERMS.index(t) for t in terms]
        X = np.array([cls.features(s) for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        if not np.all(y > 0):
            raise ValueError("step times must be positive")
        w = 1.0 / y                                   # relative error: a 2 ms decode counts as much as a 200 ms prefill
        active = [j for j in allowed if np.any(X[:, j])]
        coef = np.zeros(len(TERMS))
        while active:
            A = X[:, active] * w[:, None]
            scale = np.linalg.norm(A, axis=0)
            sol = np.linalg.lstsq(A / scale, y * w, rcond=None)[0] / scale
            if sol.min() >= 0:
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return cls(*map(float, coef))

    def relative_errors(self, samples: Iterable[tuple[StepShape, float]]) -> list[float]:
        return [(self(s) - t) / t for s, t in samples]


def measure(llm: "LLM", *, prompt_lens: Iterable[int] | None = None, prefill_batches: Iterable[int] = (1, 3),
            decode_batches: Iterable[int] | None = None, contexts: Iterable[int] | None = None,
            decode_steps: int = 6, mixed: bool = True, repeats: int = 3, seed: int = 0) -> list[tuple[StepShape, float]]:
    """Time whole ``Engine.step`` calls of ``llm`` over prefill shapes (``prefill_batches`` prompts of each of
    ``prompt_lens`` tokens, one output token), decode shapes (``decode_batches`` sequences of each of ``contexts``
    tokens, ``decode_steps`` decode steps) and, with ``mixed``, steps that carry both (a prompt arriving while a
    decode batch runs, as a loaded engine's steps do). Random prompts, so no prefix-cache hit. Each run is
    repeated ``repeats`` times and every distinct step shape keeps its median time. Shapes the engine's limits
    (budget, max_num_seqs, KV pool, max_model_len) cannot hold are skipped. Returns (shape, seconds) samples for
    ``StepCost.fit``; the engine is left empty."""
    eng = llm.engine
    if eng.has_unfinished():
        raise ValueError("measure() needs an idle engine")
    limit, budget = eng.max_model_len, eng.cfg.max_num_batched_tokens
    bs, seqs = eng.cfg.block_size, eng.cfg.max_num_seqs
    pool = eng.block_manager.num_blocks * bs
    longest = min(limit - decode_steps - 2, pool // 2)
    prompt_lens = sorted(set(prompt_lens) if prompt_lens is not None else
                         {n for n in (8, 32, 128, 512, 2048, 8192) if n <= longest} | {longest})
    contexts = sorted(set(contexts) if contexts is not None else
                      {n for n in (16, 128, 1024, 4096) if n <= longest} | {longest})
    decode_batches = sorted(set(decode_batches) if decode_batches is not None else
                            {b for b in (1, 4, 16, 64) if b <= seqs})
    # a run: (prompt_len, output tokens, the step before which it is added) per request
    runs = [[(n, 1, 0)] * b for n in prompt_lens for b in prefill_batches]
    runs += [[(c, decode_steps + 1, 0)] * b for c in contexts for b in decode_batches]
    if mixed:
        c = contexts[len(contexts) // 2]
        for b in decode_batches:
            for n in prompt_lens[1::2]:
                late = -(-b * c // budget)            # the batch's prompts are in by then: it decodes
                runs.append([(c, late + decode_steps + -(-n // budget), 0)] * b + [(n, 1, late)])
    runs = [r for r in runs if len(r) <= seqs and all(n + m <= limit for n, m, _ in r)
            and sum(n + m + bs for n, m, _ in r) <= pool]
    rng = np.random.default_rng(seed)
    times: dict[StepShape, list[float]] = {}
    plans: list = []
    real_schedule = eng.scheduler.schedule

    def schedule(*a, **k):
        plan = real_schedule(*a, **k)
        plans.append(plan)
        return plan

    def tokens(n: int) -> list[int]:
        return list(map(int, rng.integers(2, eng.vocab_size, n)))

    eng.scheduler.schedule = schedule                 # records each step's plan; the instance attribute goes after
    try:
        _run_engine(eng, [(tokens(8), 2, 0)], plans)                          # warm-up
        for _ in range(repeats):
            for run in runs:
                for shape, t in _run_engine(eng, [(tokens(n), m, k) for n, m, k in run], plans):
                    times.setdefault(shape, []).append(t)
    finally:
        del eng.scheduler.schedule
    return [(s, float(np.median(ts))) for s, ts in times.items()]


def _run_engine(eng, requests: list[tuple[list[int], int, int]], plans: list) -> list[tuple[StepShape, float]]:
    """Run ``requests`` ((token ids, output tokens, added before step k) each) to completion; (shape, seconds) of
    every step."""
    from leapdecode.sampling_params import SamplingParams
    out, step = [], 0
    pending = sorted(requests, key=lambda r: r[2])
    while pending or eng.has_unfinished():
        while pending and pending[0][2] <= step:
            prompt, m, _ = pending.pop(0)
            eng.add_request(f"measure-{next(_ids)}", prompt, SamplingParams(max_tokens=m, ignore_eos=True,
                                                                              temperature=0.0))
        plans.clear()
        t0 = time.perf_counter()
        eng.step()
        t = time.perf_counter() - t0
        step += 1
        if plans and plans[-1]:
            out.append((StepShape.of_plan(plans[-1]), t))
    return out


_ids = itertools.count()


# -- analytic ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    params: float                   # all parameters, embeddings included
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def matmul_params(self) -> float:
        """Parameters every token goes through (the transformer body: not the embedding, not the lm_head)."""
        return self.params - self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes_per_step(self) -> float:
        """Weights a step reads: the body and the lm_head (the input embedding only by rows: left out)."""
        return (self.matmul_params + self.vocab * self.hidden) * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


# Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B): 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
# MLP 14336, vocabulary 128256, untied; 8.03e9 parameters (6.98e9 in the body + 2 x 0.525e9 embedding/lm_head).
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, 128256, 8.03e9)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float                    # dense bf16 FLOP/s
    hbm_bandwidth: float            # bytes/s
    memory: float                   # bytes of device memory
    link_bandwidth: float           # bytes/s per direction between two devices of a node (NVLink)
    network_bandwidth: float        # bytes/s per device between nodes
    devices_per_node: int = 8


# H100 SXM5 80 GB (NVIDIA's datasheet): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s bidirectional
# (450 GB/s per direction); one 400 Gb/s (50 GB/s) InfiniBand NDR adapter per GPU between nodes, 8 GPUs a node.
H100_SXM = Hardware("H100 SXM 80GB", 989e12, 3.35e12, 80e9, 450e9, 50e9, 8)


@dataclass(frozen=True)
class RooflineCost:
    """t = overhead + max(compute, memory) + all-reduces; see the module doc. The efficiencies are assumptions,
    not measurements: ``mfu`` 0.6 of peak FLOP/s for prefill matmuls (large GEMMs on an H100 reach 0.6-0.75),
    ``mbu`` 0.8 of HBM bandwidth for decode (what good decode kernels reach), ``overhead_s`` 1 ms of host work and
    launches per step (CUDA graphs), an all-reduce at ``allreduce_efficiency`` 0.7 of the link's bandwidth plus
    ``allreduce_latency_s`` 10 us each."""
    model: ModelShape
    hardware: Hardware
    tp: int = 1
    mfu: float = 0.6
    mbu: float = 0.8
    overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    allreduce_efficiency: float = 0.7

    def compute_s(self, s: StepShape) -> float:
        m = self.model
        flops = (2 * m.matmul_params * s.tokens + 2 * m.vocab * m.hidden * s.seqs
                 + 4 * m.num_layers * m.num_heads * m.head_dim * s.attn_pairs)
        return flops / (self.tp * self.hardware.flops * self.mfu)

    def memory_s(self, s: StepShape) -> float:
        m = self.model
        kv = (s.kv_tokens + s.tokens) * m.kv_bytes_per_token       # read the context, write the new tokens
        return (m.weight_bytes_per_step + kv) / (self.tp * self.hardware.hbm_bandwidth * self.mbu)

    def comm_s(self, s: StepShape) -> float:
        if self.tp == 1:
            return 0.0
        m = self.model
        size = s.tokens * m.hidden * m.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * size / (self.hardware.link_bandwidth * self.allreduce_efficiency)
        return 2 * m.num_layers * (ring + self.allreduce_latency_s)

    def __call__(self, s: StepShape) -> float:
        return self.overhead_s + max(self.compute_s(s), self.memory_s(s)) + self.comm_s(s)

    def kv_capacity_tokens(self, memory_utilization: float = 0.9, reserve_bytes: float = 2e9) -> int:
        """Tokens of KV an instance of ``tp`` devices holds: ``memory_utilization`` of each device's memory, less
        its shard of the weights and ``reserve_bytes`` (activations, CUDA graphs), over its share of a token's KV."""
        per_device = self.hardware.memory * memory_utilization - self.model.weight_bytes / self.tp - reserve_bytes
        if per_device <= 0:
            return 0
        return int(per_device // (self.model.kv_bytes_per_token / self.tp))


def roofline(model: ModelShape = LLAMA3_8B, hardware: Hardware = H100_SXM, tp: int = 1, **assumptions) -> RooflineCost:
    """The analytic step cost of ``model`` on ``tp`` devices of ``hardware`` (``assumptions``: RooflineCost's
    efficiency fields)."""
    if tp < 1 or tp > model.num_heads or model.num_heads % tp:
        raise ValueError(f"tp={tp} must divide the model's {model.num_heads} attention heads")
    return RooflineCost(model, hardware, tp, **assumptions)
