"""A discrete-event simulation of a serving cluster, driven by the engine's own scheduler.

Every simulated engine instance is the real thing minus the model: a ``Scheduler`` over a ``BlockManager`` with a
``StopChecker``, exactly as ``Engine`` builds them, stepped with fabricated results (every sampling sequence
receives one token). So the batching policy the simulation models is the engine's, not a re-implementation of it:
the token budget, decodes first, chunked prefill, the waiting queue, ``max_num_seqs``, the KV pool, preemption and
recompute, prefix-cache adoption. Only time is simulated: a step that starts at t ends at t + cost(shape), with the
cost from ``step_model`` (fitted on this machine, or a roofline for stated hardware) applied to the shape of the
plan the scheduler made. As in ``Engine.step``, a step plans with the requests that have arrived by the time it
starts, and its tokens are out when it ends.

Placements:

- ``Colocated(replicas, tp)``: each instance does chunked prefill and decode in one batch; a request goes to the
  instance with the fewest outstanding tokens (prompt + output of its unfinished requests).
- ``Disaggregated(prefill, tp_prefill, decode, tp_decode)``: a prefill instance computes the prompt and samples the
  first token (TTFT ends there); the prompt's KV then travels to the least-loaded decode instance, over that
  instance's ingress link, one transfer at a time (``Cluster.transfer_s``: latency + bytes / bandwidth, NVLink
  inside a node and the network between nodes, the TP ranks sending their shards in parallel). The decode instance
  receives the KV as prefix-cache blocks (they are keyed in its pool) and the request then enters its scheduler
  like a prefix-cache hit: only the tail (the last partial block and the first token) is computed, then it decodes.

Per request the simulation reports TTFT (arrival to first token), TPOT (mean time per output token after the first:
(finish - first token) / (output_len - 1)) and finish time. ``goodput`` searches for the highest arrival rate at
which ``SLO.attainment`` of the requests meet both targets (DistServe's goodput), and reports it per device.

Not modelled: the model's outputs (lengths are given: ignore_eos, max_tokens = output_len), speculative decoding,
beam search and n > 1, pipeline parallelism, network contention beyond one transfer at a time per decode
instance, a decode instance refusing KV it has no room for (imported blocks are ordinary cached blocks: under
memory pressure they can be evicted before the request is admitted, and then it recomputes its prompt there), the
time a request spends in a router or proxy, and failures.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping, Sequence as Seq

import numpy as np

from leapdecode.cluster.step_model import LLAMA3_8B, H100_SXM, Hardware, ModelShape, StepShape, StepTime, roofline
from leapdecode.cluster.workload import SLO, SimRequest, Workload
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.scheduler import Scheduler
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import SeqResult, StepPlan, StepResult
from leapdecode.engine.stop import StopChecker
from leapdecode.sampling_params import SamplingParams

if TYPE_CHECKING:
    from leapdecode.llm import LLM

TOKEN = 0           # the token every fabricated result samples (no eos: lengths are set by max_tokens)


# -- what an instance and a cluster are -------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineShape:
    """The scheduler settings of an instance (``EngineConfig``'s names). ``num_blocks``: its KV pool; None: the
    cluster's KV capacity at the instance's TP degree."""
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    num_blocks: int | None = None
    num_window_blocks: int = 0
    recent_tokens: int = 0                # a quantized cache's recent tokens at full precision (kv_cache_recent_tokens)

    @classmethod
    def of_llm(cls, llm: "LLM") -> "EngineShape":
        """The settings of a real engine, its KV pool included."""
        eng = llm.engine
        return cls(eng.cfg.block_size, eng.cfg.max_num_batched_tokens, eng.cfg.max_num_seqs, eng.max_model_len,
                   eng.cfg.enable_prefix_caching, eng.block_manager.num_blocks, eng.block_manager.num_window_blocks,
                   eng.block_manager.recent_tokens)


@dataclass(frozen=True)
class Cluster:
    """What instances are made of. ``costs``: tp -> step cost of an instance of that many devices (the TP degrees
    a placement may use); ``kv_tokens``: tp -> its KV capacity in tokens (unless ``EngineShape.num_blocks`` says);
    ``kv_bytes_per_token``: the KV a prefill instance sends per prompt token."""
    costs: Mapping[int, StepTime]
    kv_tokens: Mapping[int, int] = field(default_factory=dict)
    engine: EngineShape = EngineShape()
    prefill_engine: EngineShape | None = None        # prefill instances' settings (None: ``engine``)
    kv_bytes_per_token: float = 0.0
    link_bandwidth: float = math.inf                 # bytes/s between two devices of a node, per direction
    network_bandwidth: float = math.inf              # bytes/s per device between nodes
    devices_per_node: int = 8
    transfer_latency_s: float = 0.0
    name: str = ""

    @classmethod
    def from_hardware(cls, model: ModelShape = LLAMA3_8B, hardware: Hardware = H100_SXM,
                      tps: Seq[int] = (1, 2, 4, 8), engine: EngineShape = EngineShape(),
                      prefill_engine: EngineShape | None = None, transfer_latency_s: float = 100e-6,
                      memory_utilization: float = 0.9, **assumptions) -> "Cluster":
        """Roofline step costs (``step_model.roofline``; ``assumptions``: its efficiency fields) and KV capacities
        of ``model`` on ``hardware`` for each TP degree in ``tps``."""
        costs = {tp: roofline(model, hardware, tp, **assumptions) for tp in tps}
        kv = {tp: c.kv_capacity_tokens(memory_utilization) for tp, c in costs.items()}
        return cls(costs, kv, engine, prefill_engine, model.kv_bytes_per_token, hardware.link_bandwidth,
                   hardware.network_bandwidth, hardware.devices_per_node, transfer_latency_s,
                   f"{model.name} on {hardware.name}")

    @property
    def tps(self) -> list[int]:
        return sorted(self.costs)

    def engine_for(self, role: str) -> EngineShape:
        return self.prefill_engine if role == "prefill" and self.prefill_engine is not None else self.engine

    def transfer_s(self, prompt_len: int, tp_prefill: int, tp_decode: int, unit_devices: int) -> float:
        """Seconds to move a prompt's KV from a prefill to a decode instance of a unit of ``unit_devices``
        devices: NVLink when the unit fits in a node, else the network; min(tp) shards go in parallel."""
        bw = self.link_bandwidth if unit_devices <= self.devices_per_node else self.network_bandwidth
        return self.transfer_latency_s + prompt_len * self.kv_bytes_per_token / (bw * min(tp_prefill, tp_decode))


@dataclass(frozen=True)
class Colocated:
    """``replicas`` identical instances of ``tp`` devices, each serving prefill and decode in one batch.
    ``max_num_batched_tokens``: the step's token budget (the prefill chunk size); None: the cluster's engine's."""
    replicas: int = 1
    tp: int = 1
    max_num_batched_tokens: int | None = None

    @property
    def devices(self) -> int:
        return self.replicas * self.tp

    @property
    def label(self) -> str:
        budget = f", budget {self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        return f"colocated {self.replicas} x TP{self.tp}{budget}"


@dataclass(frozen=True)
class Disaggregated:
    """``prefill`` instances of ``tp_prefill`` devices and ``decode`` instances of ``tp_decode`` devices."""
    prefill: int = 1
    tp_prefill: int = 1
    decode: int = 1
    tp_decode: int = 1

    @property
    def devices(self) -> int:
        return self.prefill * self.tp_prefill + self.decode * self.tp_decode

    @property
    def label(self) -> str:
        return f"disaggregated {self.prefill}P x TP{self.tp_prefill} + {self.decode}D x TP{self.tp_decode}"


Placement = Colocated | Disaggregated


# -- results ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestResult:
    request: SimRequest
    first_token: float
    finish: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.request.arrival

    @property
    def tpot(self) -> float:
        n = self.request.output_len
        return (self.finish - self.first_token) / (n - 1) if n > 1 else 0.0


@dataclass
class SimResult:
    results: list[RequestResult]          # finished requests, in trace order
    num_requests: int
    complete: bool = True                 # False: stopped once the SLO verdict was certain
    passed: bool | None = None            # with an SLO: did >= attainment of the requests meet it
    num_steps: int = 0
    num_preemptions: int = 0
    max_in_flight: int = 0                # most requests arrived and not finished at once
    busy_s: list[float] = field(default_factory=list)    # per instance

    def ttfts(self) -> np.ndarray:
        return np.array([r.ttft for r in self.results])

    def tpots(self) -> np.ndarray:
        return np.array([r.tpot for r in self.results if r.request.output_len > 1])

    def percentile(self, metric: str, q: float) -> float:
        values = self.ttfts() if metric == "ttft" else self.tpots()
        return float(np.percentile(values, q)) if len(values) else 0.0

    def attainment(self, slo: SLO) -> float:
        return sum(slo.met(r.ttft, r.tpot) for r in self.results) / self.num_requests


# -- the simulation ---------------------------------------------------------------------------------------------
# At equal times: arrivals first (a step starting then sees them), a step's end before a deadline it meets, kicks
# (step starts) last.
_ARRIVE, _DONE, _IMPORT, _DEADLINE, _KICK = range(5)


@dataclass
class _Req:
    req: SimRequest
    first_token: float | None = None
    finish: float | None = None
    missed: bool = False


class _Instance:
    """One engine instance: the real scheduler, its pool, and a virtual clock's bookkeeping."""

    def __init__(self, index: int, role: str, cost: StepTime, engine: EngineShape, num_blocks: int,
                 tp: int) -> None:
        self.index, self.role, self.cost, self.tp = index, role, cost, tp
        self.bm = BlockManager(num_blocks, engine.block_size, engine.enable_prefix_caching, engine.num_window_blocks,
                               engine.recent_tokens)
        self.scheduler = Scheduler(self.bm, engine.max_num_batched_tokens, engine.max_num_seqs,
                                   StopChecker(set(), engine.max_model_len))
        self.seqs: dict[int, Sequence] = {}
        self.owner: dict[int, _Req] = {}
        self.busy = self.kicked = False
        self.load = 0                 # outstanding tokens (prompt + output) of its unfinished requests
        self.link_free = 0.0          # decode instances: when the KV ingress link is free
        self.busy_s = 0.0

    def add(self, seq: Sequence, r: _Req) -> None:
        self.seqs[seq.seq_id] = seq
        self.owner[seq.seq_id] = r
        self.load += r.req.prompt_len + r.req.output_len
        self.scheduler.add(seq)

    def done(self, seq: Sequence) -> _Req:
        del self.seqs[seq.seq_id]
        r = self.owner.pop(seq.seq_id)
        self.load -= r.req.prompt_len + r.req.output_len
        return r

    def import_kv(self, tokens: list[int]) -> None:
        """Key the blocks a transferred prompt fills in this pool, as the prefix cache would after computing them,
        so the request adopts them when admitted. Nothing happens if the pool has no free blocks for them."""
        bs = self.bm.block_size
        n = (len(tokens) - 1) // bs * bs             # what match_prefix may adopt (>= 1 token left to compute)
        if n == 0:
            return
        carrier = Sequence("kv-import", 0, tokens, _PARAMS_ONE)
        if self.bm.allocate(carrier, n):
            self.bm.commit(carrier, n)
            self.bm.free_seq(carrier)


_PARAMS_ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _fabricate(plan: StepPlan) -> StepResult:
    return StepResult(plan.step_id, {c.seq_id: SeqResult(c.seq_id, (), (TOKEN,)) for c in plan.seqs if c.samples})


def _prompt(r: SimRequest) -> list[int]:
    """Synthetic prompt tokens, distinct per request from the first block on (no accidental prefix-cache hit)."""
    return [r.index + 1] * r.prompt_len


def pool_blocks(cluster: Cluster, engine: EngineShape, tp: int, requests: Seq[SimRequest]) -> int:
    """The KV pool of an instance: ``engine.num_blocks``, or the cluster's capacity at ``tp``, capped at what the
    whole trace could ever hold at once (a bigger pool behaves the same, and costs time to build)."""
    bs = engine.block_size
    if engine.num_blocks is not None:
        return engine.num_blocks
    if tp not in cluster.kv_tokens:
        raise ValueError(f"the cluster has no KV capacity for tp={tp}; give EngineShape.num_blocks")
    need = sum(-(-(r.prompt_len + r.output_len) // bs) + 1 for r in requests)
    return min(cluster.kv_tokens[tp] // bs, need)


def simulate(placement: Placement, cluster: Cluster, requests: Seq[SimRequest], *, slo: SLO | None = None,
             decide: bool = False, phase: str = "both") -> SimResult:
    """Run ``requests`` through ``placement`` on a virtual clock. With ``slo`` and ``decide``, stop as soon as the
    verdict (>= slo.attainment of the requests meet it) is certain (``SimResult.passed``; the results then hold
    only the requests finished so far). ``phase`` (disaggregated placements, for the planner's per-phase
    estimates): "prefill" ends each request at its first token and judges TTFT only; "decode" hands each request to
    a decode instance at its arrival, as if prefilled and transferred in no time, and judges TPOT only."""
    if phase not in ("both", "prefill", "decode"):
        raise ValueError(f"phase must be 'both', 'prefill' or 'decode', got {phase!r}")
    if phase != "both" and not isinstance(placement, Disaggregated):
        raise ValueError("phase applies to disaggregated placements")
    too_long = [r for r in requests if r.prompt_len + r.output_len > cluster.engine.max_model_len]
    if too_long:
        raise ValueError(f"request {too_long[0].index} ({too_long[0].prompt_len} + {too_long[0].output_len} tokens) "
                         f"exceeds max_model_len={cluster.engine.max_model_len}")
    if slo is not None and phase != "both":
        slo = replace(slo, ttft_s=math.inf) if phase == "decode" else replace(slo, tpot_s=math.inf)

    def make(role: str, count: int, tp: int, budget: int | None = None) -> list[_Instance]:
        if tp not in cluster.costs:
            raise ValueError(f"the cluster has no step cost for tp={tp} (it has {cluster.tps})")
        engine = cluster.engine_for(role)
        if budget is not None:
            engine = replace(engine, max_num_batched_tokens=budget)
        blocks = pool_blocks(cluster, engine, tp, requests)
        return [_Instance(i, role, cluster.costs[tp], engine, blocks, tp) for i in range(count)]

    if isinstance(placement, Colocated):
        front = make("colocated", placement.replicas, placement.tp, placement.max_num_batched_tokens)
        back: list[_Instance] = []
    else:
        front = make("prefill", placement.prefill, placement.tp_prefill) if phase != "decode" else []
        back = make("decode", placement.decode, placement.tp_decode) if phase != "prefill" else []
    instances = front + back
    disagg = isinstance(placement, Disaggregated)

    events: list = []
    order = itertools.count()

    def push(t: float, kind: int, *payload) -> None:
        heapq.heappush(events, (t, kind, next(order), payload))

    def kick(inst: _Instance, t: float) -> None:
        if not inst.busy and not inst.kicked:
            inst.kicked = True
            push(t, _KICK, inst)

    states = [_Req(r) for r in requests]
    for r in states:
        push(r.req.arrival, _ARRIVE, r)
    deadlines = decide and slo is not None          # misses are known at the deadline, not at the late token
    if deadlines and slo.ttft_s < math.inf:
        for r in states:
            push(r.req.arrival + slo.ttft_s, _DEADLINE, r, "ttft")
    n = len(states)
    needed = math.ceil(slo.attainment * n - 1e-9) if slo is not None else 0
    met = missed = 0
    verdict: bool | None = None
    steps = in_flight = max_in_flight = 0

    def least_loaded(pool: list[_Instance]) -> _Instance:
        return min(pool, key=lambda i: (i.load, i.index))

    def finished(r: _Req, t: float) -> None:
        nonlocal met, verdict, in_flight
        r.finish = t
        in_flight -= 1
        if slo is None:
            return
        if r.missed:
            return
        if not slo.met(r.first_token - r.req.arrival, _tpot(r)):
            miss(r)
            return
        met += 1
        if decide and verdict is None and met >= needed:
            verdict = True

    def miss(r: _Req) -> None:
        nonlocal missed, verdict
        if not r.missed:                              # counted once
            r.missed = True
            missed += 1
            if decide and verdict is None and missed > n - needed:
                verdict = False

    def first_token(r: _Req, t: float) -> None:
        r.first_token = t
        if slo is None:
            return
        if t - r.req.arrival > slo.ttft_s:
            miss(r)
        elif deadlines and slo.tpot_s < math.inf and r.req.output_len > 1:
            push(t + slo.tpot_s * (r.req.output_len - 1), _DEADLINE, r, "tpot")

    def to_decode(r: _Req, t: float) -> None:
        """The prompt's KV leaves for the least-loaded decode instance (``phase`` "decode": already there)."""
        inst = least_loaded(back)
        inst.load += r.req.prompt_len + r.req.output_len      # reserved from now, so routing sees it
        if phase == "decode":
            push(t, _IMPORT, r, inst)
            return
        start = max(t, inst.link_free)
        inst.link_free = start + cluster.transfer_s(r.req.prompt_len, placement.tp_prefill, placement.tp_decode,
                                                    placement.devices)
        push(inst.link_free, _IMPORT, r, inst)

    while events and verdict is None:
        t, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            (r,) = payload
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            if phase == "decode":
                first_token(r, t)
                to_decode(r, t)
                continue
            inst = least_loaded(front)
            max_tokens = 1 if disagg else r.req.output_len
            inst.add(Sequence(str(r.req.index), 0, _prompt(r.req), _params(max_tokens)), r)
            kick(inst, t)
        elif kind == _IMPORT:
            r, inst = payload
            tokens = _prompt(r.req) + [TOKEN]
            inst.import_kv(tokens)
            seq = Sequence(str(r.req.index), 0, _prompt(r.req), _params(r.req.output_len))
            seq.token_ids.append(TOKEN)               # the first token, sampled by the prefill instance
            inst.load -= r.req.prompt_len + r.req.output_len        # add() counts it again
            inst.add(seq, r)
            kick(inst, t)
        elif kind == _DEADLINE:
            r, which = payload
            if (r.first_token if which == "ttft" else r.finish) is None:
                miss(r)
        elif kind == _KICK:
            (inst,) = payload
            inst.kicked = False
            plan = inst.scheduler.schedule()
            if not plan:
                if inst.scheduler.waiting or inst.scheduler.running:
                    raise RuntimeError(f"instance {inst.role}{inst.index} cannot schedule its requests: a prompt "
                                       f"does not fit in its KV pool of {inst.bm.num_blocks} blocks")
                continue
            d = inst.cost(StepShape.of_plan(plan))
            inst.busy = True
            inst.busy_s += d
            steps += 1
            push(t + d, _DONE, inst, plan)
        else:                                         # _DONE: the step's tokens are out
            inst, plan = payload
            upd = inst.scheduler.update(plan, _fabricate(plan), inst.seqs)
            inst.busy = False
            for seq in upd.touched:
                r = inst.owner[seq.seq_id]
                if r.first_token is None:
                    first_token(r, t)
            for seq in upd.finished:
                r = inst.done(seq)
                if inst.role == "prefill" and phase == "both" and r.req.output_len > 1:
                    to_decode(r, t)
                else:
                    finished(r, t)
            kick(inst, t)

    done = [RequestResult(r.req, r.first_token, r.finish) for r in states if r.finish is not None]
    return SimResult(done, n, verdict is None and len(done) == n,
                     verdict if verdict is not None else (met >= needed if slo is not None else None),
                     steps, sum(i.scheduler.num_preemptions for i in instances), max_in_flight,
                     [i.busy_s for i in instances])


def _tpot(r: _Req) -> float:
    n = r.req.output_len
    return (r.finish - r.first_token) / (n - 1) if n > 1 else 0.0


# -- goodput ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goodput:
    placement: Placement
    rate: float                 # requests/s served with >= attainment of them meeting the SLO (0: not even alone)
    per_device: float
    evaluations: int            # rates the search tried
    num_requests: int           # trace length behind the verdict at ``rate``
    trace_limited: bool = False  # a higher rate could not be judged within max_requests: the rate is a lower bound


def rate_guess(placement: Placement, cluster: Cluster, workload: Workload) -> float:
    """A rough capacity (requests/s) to start the goodput search from: prefill time of a mean prompt plus the
    share of a batch-32 decode step per output token."""
    p, o = workload.mean_lengths()
    p, o = max(int(p), 1), max(o, 1.0)

    def per_request(tp: int, prefill: bool, decode: bool) -> float:
        c = cluster.costs[tp]
        t = c(StepShape.prefill(p)) if prefill else 0.0
        return t + (o * c(StepShape.decode(32, int(p + o / 2))) / 32 if decode else 0.0)

    if isinstance(placement, Colocated):
        return placement.replicas / per_request(placement.tp, True, True)
    return min(placement.prefill / per_request(placement.tp_prefill, True, False),
               placement.decode / per_request(placement.tp_decode, False, True))


def meets(placement: Placement, cluster: Cluster, workload: Workload, slo: SLO, *, phase: str = "both",
          max_requests: int = 4000, min_requests: int = 0) -> tuple[bool, int, bool]:
    """Does the trace of ``workload`` meet ``slo``? A finite trace can pass at a rate the cluster could not
    sustain: if all of it fits in flight at once it is one burst, which a large decode batch absorbs, and a queue
    that grows without end still meets a loose TTFT target for a while. So a pass counts only if the trace is at
    least twice the number of requests in flight (the most seen at once, or the rate times the mean latency,
    whichever is larger): then about half of it runs in the steady state. Otherwise the trace is lengthened (at
    least doubled; the same requests first: common random numbers) and run again, up to ``max_requests``; a pass
    that would need a longer trace than that is not trusted: it is a fail, flagged as trace-limited.
    ``min_requests``: start that long (what an earlier, lower rate needed). Returns (verdict, trace length,
    trace-limited)."""
    n = min(max(workload.num_requests, min_requests), max_requests)
    while True:
        res = simulate(placement, cluster, replace(workload, num_requests=n).requests(), slo=slo, decide=True,
                       phase=phase)
        if not res.passed:
            return False, n, False
        latency = [r.finish - r.request.arrival for r in res.results]
        in_flight = max(res.max_in_flight, workload.rate * sum(latency) / max(len(latency), 1))
        if 2 * in_flight <= n:
            return True, n, False
        if n >= max_requests:
            return False, n, True
        n = min(max_requests, max(2 * n, math.ceil(2.5 * in_flight)))


def goodput(placement: Placement, cluster: Cluster, workload: Workload, slo: SLO, *, rtol: float = 0.05,
            start: float | None = None, phase: str = "both", max_evaluations: int = 30,
            max_requests: int = 4000) -> Goodput:
    """The highest rate (within ``rtol``) at which the trace meets ``slo`` (``meets``): double (or halve) from
    ``start`` (a rough capacity if None) until the verdict changes, then bisect geometrically. The trace at each
    rate is the workload's with its arrival gaps scaled (workload.py), so the verdict is nearly monotone in the
    rate."""
    evals = 0
    lengths: dict[float, int] = {}

    def ok(rate: float) -> bool:
        nonlocal evals
        evals += 1
        below = [n for r, (n, _) in lengths.items() if r < rate]     # a higher rate needs at least as long a trace
        verdict, n, limited = meets(placement, cluster, workload.at_rate(rate), slo, phase=phase,
                                    max_requests=max_requests, min_requests=max(below, default=0))
        lengths[rate] = (n, limited)
        return verdict

    r = start or rate_guess(placement, cluster, workload)
    lo = hi = None
    if ok(r):
        lo = r
        while hi is None and evals < max_evaluations:
            r *= 2
            if ok(r):
                lo = r
            else:
                hi = r
    else:
        hi = r
        while lo is None and evals < max_evaluations:
            r /= 2
            if r < hi * 1e-4:                         # not even a trickle of requests meets the SLO
                return Goodput(placement, 0.0, 0.0, evals, workload.num_requests)
            if ok(r):
                lo = r
            else:
                hi = r
    if lo is None:
        return Goodput(placement, 0.0, 0.0, evals, workload.num_requests)
    if hi is None:
        hi = lo * 2
    while hi / lo > 1 + rtol and evals < max_evaluations:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    limited = any(lim for r, (_, lim) in lengths.items() if r > lo)
    devices = placement.devices if phase == "both" else (
        placement.prefill * placement.tp_prefill if phase == "prefill" else placement.decode * placement.tp_decode)
    return Goodput(placement, lo, lo / devices, evals, lengths[lo][0], limited)
