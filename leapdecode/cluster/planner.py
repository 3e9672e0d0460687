"""The goodput planner (DistServe, Zhong et al., OSDI'24): choose how N devices serve a workload under latency
targets, co-located replicas or disaggregated prefill and decode instances, each with its tensor-parallel degree,
so that goodput per device is highest.

Units and replicas. A placement is a *unit* (one co-located instance of TP devices, or P prefill instances of
tp_p devices plus D decode instances of tp_d devices) copied ``N // unit devices`` times behind a load balancer
that splits the arrivals evenly. The cluster's goodput is taken as copies x the unit's goodput: that is the
approximation (an even split of a Poisson stream is Poisson at the split rate, so each copy sees the unit's
workload; a least-loaded balancer does at least as well), and what keeps planning for 64 devices as fast as for
8. Units are at most ``max_unit`` devices (default: one node), so the KV of a disaggregated unit moves over
NVLink, as in DistServe's placement for clusters with slow cross-node links (its "low node-affinity" algorithm).

Search (branch and bound, with estimates for bounds). Every candidate unit first gets an optimistic rate, a unit
not beating its slower phase: for a co-located instance the smaller of its prefill rate (full budgets of prompt tokens back to back) and
its decode capacity; for a disaggregated unit, as DistServe estimates each phase apart, P times the prefill
goodput of one prefill instance (simulated, TTFT only) against D times the decode capacity of one decode
instance (analytic: the largest batch B whose step at the mean context fits the TPOT target serves
B / (t(B) * output tokens) requests/s, within max_num_seqs and the KV pool), with the P:D counts that fit in a
unit and maximise it per device, per (tp_p, tp_d). These are estimates, not strict bounds (the analytic decode
capacity takes the mean context; the simulator can come out ~10% above it). Units are then simulated whole (both
SLOs, chunked prefill, KV transfer) by a full goodput search, in the order of their estimate, while the estimate
plus ``rtol`` can beat the best simulated goodput per device (at most ``max_disaggregated`` disaggregated units;
the best-estimate unit of each kind always, so the table compares the two). The choice is the simulated
candidate with the highest goodput per device; estimates are listed, marked as such, never chosen. Goodputs are found to within ``rtol``, so candidates closer than
that are a tie.

Cost. The simulation runs the real scheduler, ~10-20 us of Python per sequence per step, and the goodput search
lengthens a trace until it holds the steady state (``simulator.meets``): with loose SLOs on fast hardware
hundreds of requests are in flight, and a plan takes about a minute on one core (``max_requests``, ``rtol``,
``tps`` and ``budgets`` trade accuracy for time).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from leapdecode.cluster.simulator import Cluster, Colocated, Disaggregated, Goodput, Placement, goodput
from leapdecode.cluster.step_model import StepShape
from leapdecode.cluster.workload import SLO, LogNormal, Workload


@dataclass(frozen=True)
class Candidate:
    unit: Placement
    copies: int                 # units in the cluster
    devices: int                # the cluster's devices (some may be left idle: devices - copies * unit devices)
    rate: float                 # the cluster's goodput, requests/s
    simulated: bool             # False: an estimate only (not simulated: it could not beat the choice)
    evaluations: int = 0
    trace_limited: bool = False  # a higher rate needed a longer trace than allowed: the rate is a lower bound

    @property
    def per_device(self) -> float:
        return self.rate / self.devices

    @property
    def kind(self) -> str:
        return "colocated" if isinstance(self.unit, Colocated) else "disaggregated"

    @property
    def label(self) -> str:
        return f"{self.copies} x ({self.unit.label})"


@dataclass
class Plan:
    devices: int
    cluster: str
    workload: Workload
    slo: SLO
    best: Candidate | None          # None: no placement meets the SLO at any rate
    candidates: list[Candidate]     # best per device first
    seconds: float                  # planning time
    rtol: float = 0.1               # goodput resolution


class Planner:
    """Plans for one cluster, workload and SLO; unit goodputs are kept, so plans for several cluster sizes share
    their simulations."""

    def __init__(self, cluster: Cluster, workload: Workload, slo: SLO, *, tps: Iterable[int] | None = None,
                 budgets: Iterable[int | None] = (None,), max_unit: int | None = None, max_disaggregated: int = 3,
                 rtol: float = 0.1, max_requests: int = 1500) -> None:
        self.cluster, self.workload, self.slo = cluster, workload, slo
        self.tps = sorted(set(tps if tps is not None else cluster.tps) & set(cluster.tps))
        if not self.tps:
            raise ValueError(f"no TP degree to plan with: the cluster has step costs for {cluster.tps}")
        self.budgets = tuple(budgets)
        self.max_unit = max_unit or cluster.devices_per_node
        self.max_disaggregated, self.rtol, self.max_requests = max_disaggregated, rtol, max_requests
        self._goodputs: dict[tuple, Goodput] = {}

    def goodput(self, unit: Placement, phase: str = "both", start: float | None = None) -> Goodput:
        key = (unit, phase)
        if key not in self._goodputs:
            self._goodputs[key] = goodput(unit, self.cluster, self.workload, self.slo, rtol=self.rtol, start=start,
                                          phase=phase, max_requests=self.max_requests)
        return self._goodputs[key]

    def decode_capacity(self, tp: int) -> float:
        """Requests/s one decode instance of ``tp`` devices serves within the TPOT target, analytically (see the
        module doc)."""
        p, o = self.workload.mean_lengths()
        if o <= 1:
            return float("inf")
        engine = self.cluster.engine_for("decode")
        ctx = int(p + o / 2)
        pool = (engine.num_blocks * engine.block_size if engine.num_blocks is not None
                else self.cluster.kv_tokens.get(tp, 1 << 62))
        most = min(engine.max_num_seqs, pool // max(ctx + engine.block_size, 1))
        cost = self.cluster.costs[tp]
        best = 0.0
        for b in range(1, most + 1):
            t = cost(StepShape.decode(b, ctx))
            if t > self.slo.tpot_s:
                break
            best = max(best, b / (t * (o - 1)))
        return best

    def prefill_capacity(self, tp: int, budget: int | None) -> float:
        """An optimistic prefill rate (requests/s) for a co-located instance: every step a full budget of prompt
        tokens from position 0 (the least attention), nothing else."""
        engine = self.cluster.engine
        budget = budget or engine.max_num_batched_tokens
        p, _ = self.workload.mean_lengths()
        return budget / self.cluster.costs[tp](StepShape.prefill(budget)) / max(p, 1.0)

    def plan(self, devices: int) -> Plan:
        t0 = time.perf_counter()
        limit = min(devices, self.max_unit)
        tps = [tp for tp in self.tps if tp <= limit]
        if not tps:
            raise ValueError(f"no TP degree in {self.tps} fits in {devices} devices")
        decode = {tp: self.decode_capacity(tp) for tp in tps}

        # optimistic rates per unit: a unit does not beat its slower phase
        bounds: list[tuple[float, Placement]] = []
        for tp in tps:
            for budget in self.budgets:
                bounds.append((min(self.prefill_capacity(tp, budget), decode[tp]), Colocated(1, tp, budget)))
        prefill = {tp: self.goodput(Disaggregated(1, tp, 1, tps[0]), phase="prefill").rate for tp in tps}
        for tp_p in tps:
            for tp_d in tps:
                best = None                          # the P:D counts with the best estimate per device
                for n_p in range(1, limit // tp_p + 1):
                    for n_d in range(1, (limit - n_p * tp_p) // tp_d + 1):
                        unit = Disaggregated(n_p, tp_p, n_d, tp_d)
                        rate = min(n_p * prefill[tp_p], n_d * decode[tp_d])
                        per_device = (devices // unit.devices) * rate / devices
                        if rate > 0 and (best is None or per_device > best[0] + 1e-12):
                            best = (per_device, rate, unit)
                if best is not None:
                    bounds.append(best[1:])

        # simulate in the order of the estimates while one can still beat the best simulated (with rtol of slack:
        # the estimates are not strict bounds); the best-estimate unit of each kind always, so the table compares
        # the two; a unit simulated for another cluster size costs nothing
        def per_device(rate: float, unit: Placement) -> float:
            return (devices // unit.devices) * rate / devices

        bounds.sort(key=lambda b: (-per_device(*b), b[1].devices))
        out: list[Candidate] = []
        first = {Colocated: True, Disaggregated: True}
        disaggregated = 0
        for rate, unit in bounds:
            best_sim = max((c.per_device for c in out if c.simulated), default=0.0)
            kind = type(unit)
            allowed = kind is Colocated or disaggregated < self.max_disaggregated
            promising = allowed and per_device(rate, unit) * (1 + self.rtol) > best_sim
            if rate > 0 and (first[kind] or promising or (unit, "both") in self._goodputs):
                g = self.goodput(unit, start=rate)
                out.append(Candidate(unit, devices // unit.devices, devices, devices // unit.devices * g.rate, True,
                                     g.evaluations, g.trace_limited))
                first[kind] = False
                disaggregated += kind is Disaggregated
            else:
                out.append(Candidate(unit, devices // unit.devices, devices, devices // unit.devices * rate, False))
        out.sort(key=lambda c: (-c.per_device, not c.simulated, c.unit.devices))
        winners = [c for c in out if c.simulated and c.rate > 0]
        return Plan(devices, self.cluster.name, self.workload, self.slo, winners[0] if winners else None, out,
                    time.perf_counter() - t0, self.rtol)


def plan(cluster: Cluster, workload: Workload, slo: SLO, devices: int, **kw) -> Plan:
    """The best placement of ``workload`` on ``devices`` devices (see ``Planner``)."""
    return Planner(cluster, workload, slo, **kw).plan(devices)


# -- the plans printed for the issue ----------------------------------------------------------------------------
# Lengths: chat roughly as ShareGPT conversations (lognormal, mean ~1k prompt / ~256 output tokens);
# summarization as long documents with short summaries (LongBench-like, mean ~3k / ~128). SLOs: DistServe's
# Table 1 for its chatbot (TTFT 0.25 s, TPOT 0.1 s; OPT-13B) and summarization (TTFT 15 s, TPOT 0.15 s; OPT-66B)
# workloads, and a tight one of ours for long prompts (TTFT 1 s, TPOT 15 ms: ~67 tokens/s per stream). Co-located
# instances may chunk prefill at the engine's 2048 tokens or at 512 (smaller chunks: less interference).
CHAT = Workload(input=LogNormal(1024, 0.8, 16, 6144), output=LogNormal(256, 0.8, 2, 1536), num_requests=200,
                name="chat")
SUMMARIZATION = Workload(input=LogNormal(3000, 0.5, 512, 7168), output=LogNormal(128, 0.6, 2, 512),
                         num_requests=200, name="summarization")
SCENARIOS = {
    "chat": ("chat, DistServe's chatbot SLO", CHAT, SLO(0.25, 0.1)),
    "summarization": ("summarization, DistServe's SLO", SUMMARIZATION, SLO(15.0, 0.15)),
    "long-tight": ("long prompts, tight TPOT", SUMMARIZATION, SLO(1.0, 0.015)),
}
BUDGETS = (None, 512)


def print_plan(plans: Plan | list[Plan], console=None, title: str = "", top: int = 8) -> None:
    """Print plans as tables, labelled SIMULATED; ``top`` candidates each (the choice is always shown)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=140)
    for p in [plans] if isinstance(plans, Plan) else plans:
        w, s = p.workload, p.slo
        pin, pout = w.mean_lengths()
        head = (f"SIMULATED plan: {p.devices} devices, {p.cluster}. {title or w.name}: mean prompt {pin:.0f}, "
                f"mean output {pout:.0f} tokens; SLO TTFT <= {s.ttft_s:g} s and TPOT <= {s.tpot_s * 1e3:g} ms for "
                f"{s.attainment:.0%} of requests")
        table = Table(title=head, title_justify="left")
        for col in ("", "placement", "devices used", "goodput req/s", "per device", "how"):
            table.add_column(col, justify="left" if col in ("", "placement", "how") else "right")
        shown = p.candidates[:top]
        if p.best is not None and p.best not in shown:
            shown.append(p.best)
        for c in shown:
            table.add_row("*" if c is p.best else "", c.label, f"{c.copies * c.unit.devices}/{c.devices}",
                          f"{c.rate:.2f}", f"{c.per_device:.3f}",
                          (f"simulated ({c.evaluations} rates)" + (", trace-limited" if c.trace_limited else ""))
                          if c.simulated else "estimate, not simulated")
        console.print(table)
        if p.best is None:
            console.print("no placement meets the SLO at any rate")
        console.print(f"* = the choice (highest simulated goodput per device); goodputs within {p.rtol:.0%} are a tie; "
                      f"planned in {p.seconds:.1f} s\n")


def main(argv: list[str] | None = None) -> None:
    """python -m leapdecode.cluster.planner [--devices 8 64] [--scenarios chat summarization long-tight]: plans for
    Llama-3-8B on H100 SXM figures (step_model.roofline and its stated assumptions)."""
    import argparse

    from leapdecode.cluster.step_model import H100_SXM, LLAMA3_8B
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--rtol", type=float, default=0.1)
    args = ap.parse_args(argv)
    cluster = Cluster.from_hardware(LLAMA3_8B, H100_SXM)
    for name in args.scenarios:
        title, workload, slo = SCENARIOS[name]
        planner = Planner(cluster, workload, slo, budgets=BUDGETS, rtol=args.rtol)
        print_plan([planner.plan(n) for n in args.devices], title=title)


if __name__ == "__main__":
    main()
