"""The simulator against the real engine: run a request trace through a real ``LLM`` and through the simulation of
one co-located instance with the same settings, and compare TTFT and TPOT.

``run_engine`` drives a real engine through a trace, on one of two clocks:

- a **virtual** clock (``cost`` given): each step of the real engine advances the clock by ``cost`` applied to the
  shape of the plan the real scheduler made. Both sides then run the same scheduler on the same clock, so the
  simulation must reproduce the run exactly: that is the deterministic check the tests make (tests/test_cluster_sim.py).
  It shows that the simulator's event loop (arrivals seen by the next step, tokens out at the end of a step, an
  idle engine waiting for the next arrival) and its fabricated results make the scheduler do what it does in
  the engine, preemptions included.
- the **wall** clock (``cost`` None): requests are submitted when their arrival time comes and TTFT/TPOT are
  measured in real time. ``validate_against_engine`` puts that beside the simulation with a step cost fitted on
  this machine (``step_model.measure``), which is how well the simulator predicts a real run here. Timings are
  noisy, so this is a benchmark (benchmarks/), never a test.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Sequence as Seq

import numpy as np

from leapdecode.cluster.simulator import Cluster, Colocated, EngineShape, RequestResult, SimResult, simulate
from leapdecode.cluster.step_model import StepCost, StepShape, StepTime, measure
from leapdecode.cluster.workload import SimRequest, Workload

if TYPE_CHECKING:
    from leapdecode.llm import LLM


def run_engine(llm: "LLM", requests: Seq[SimRequest], cost: StepTime | None = None, seed: int = 0,
               steps_out: list | None = None) -> SimResult:
    """Serve ``requests`` (random prompt tokens of their lengths, greedy, ignore_eos, max_tokens = output_len) on
    ``llm``'s engine, on the virtual clock of ``cost`` or, without one, the wall clock; per request its first
    token and finish times. ``steps_out``: gets (shape, seconds) of every step. The engine must be idle and is
    left idle."""
    from leapdecode.sampling_params import SamplingParams

    eng = llm.engine
    if eng.has_unfinished():
        raise ValueError("run_engine needs an idle engine")
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(2, eng.vocab_size, r.prompt_len))) for r in requests]
    pending = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    plans: list = []
    real_schedule = eng.scheduler.schedule

    def schedule(*a, **k):
        plan = real_schedule(*a, **k)
        plans.append(plan)
        return plan

    preemptions, steps = eng.scheduler.num_preemptions, 0
    virtual = cost is not None
    now, t0 = 0.0, time.perf_counter()
    eng.scheduler.schedule = schedule
    try:
        while pending or eng.has_unfinished():
            if not virtual:
                now = time.perf_counter() - t0
            while pending and requests[pending[0]].arrival <= now:
                i = pending.pop(0)
                eng.add_request(f"sim-{i}", prompts[i], SamplingParams(max_tokens=requests[i].output_len,
                                                                       ignore_eos=True, temperature=0.0))
            if not eng.has_unfinished():              # idle until the next arrival
                wait = requests[pending[0]].arrival - now
                if virtual:
                    now += wait
                else:
                    time.sleep(max(wait, 0.0))
                continue
            plans.clear()
            started = time.perf_counter()
            outputs = eng.step()
            took = time.perf_counter() - started
            plan = plans[-1] if plans else None
            if not plan:
                raise RuntimeError("the engine made an empty step with requests unfinished")
            steps += 1
            shape = StepShape.of_plan(plan)
            if steps_out is not None:
                steps_out.append((shape, took))
            now = now + cost(shape) if virtual else time.perf_counter() - t0
            for out in outputs:
                i = int(out.request_id.removeprefix("sim-"))
                if i not in first and out.outputs[0].token_ids:
                    first[i] = now
                if out.finished:
                    finish[i] = now
    finally:
        del eng.scheduler.schedule
    results = [RequestResult(requests[i], first[i], finish[i]) for i in range(len(requests))]
    return SimResult(results, len(requests), True, None, steps, eng.scheduler.num_preemptions - preemptions)


def compare(measured: SimResult, simulated: SimResult, percentiles: Iterable[float] = (50, 90)) -> list[dict]:
    """Table rows: TTFT and TPOT percentiles of both runs and the simulation's relative error."""
    rows = []
    for metric in ("ttft", "tpot"):
        for q in percentiles:
            m, s = measured.percentile(metric, q), simulated.percentile(metric, q)
            rows.append({"metric": f"{metric.upper()} p{q:g}", "measured_s": m, "simulated_s": s,
                         "error": (s - m) / m if m else float("nan")})
    rows.append({"metric": "steps", "measured_s": measured.num_steps, "simulated_s": simulated.num_steps,
                 "error": (simulated.num_steps - measured.num_steps) / max(measured.num_steps, 1)})
    return rows


def validate_against_engine(llm: "LLM", workload: Workload, cost: StepTime | None = None, *,
                            percentiles: Iterable[float] = (50, 90), seed: int = 0, **measure_kw) -> list[dict]:
    """Serve ``workload``'s trace on ``llm`` in real time and simulate it on one co-located instance with the
    engine's settings, with ``cost`` or else a ``StepCost`` fitted now on this machine (``step_model.measure(llm,
    **measure_kw)``, before the run). Returns table rows (metric, measured_s, simulated_s, error: the simulation's
    relative error): TTFT and TPOT percentiles and the step count, then "step time" rows that say where an error
    comes from: the cost model's mean absolute relative error on the probe samples it was fitted on, and on the
    real run's own steps (a model that is right on its probes and wrong on the run's steps means the steps of a
    loaded engine cost more than the same shapes in isolation, e.g. caches, garbage collection, a shared CPU)."""
    probe_error = float("nan")
    if cost is None:
        samples = measure(llm, **measure_kw)
        cost = StepCost.fit(samples)
        probe_error = float(np.mean(np.abs(StepCost.relative_errors(cost, samples))))
    requests = workload.requests()
    steps: list = []
    measured = run_engine(llm, requests, seed=seed, steps_out=steps)
    simulated = simulate(Colocated(), Cluster({1: cost}, engine=EngineShape.of_llm(llm)), requests)
    rows = compare(measured, simulated, percentiles)
    run_error = float(np.mean([abs(cost(s) - t) / t for s, t in steps]))
    rows.append({"metric": "step time, probes (mean |rel. error|)", "measured_s": None, "simulated_s": None,
                 "error": probe_error})
    rows.append({"metric": "step time, this run (mean |rel. error|)", "measured_s": float(np.mean([t for _, t in steps])),
                 "simulated_s": float(np.mean([cost(s) for s, _ in steps])), "error": run_error})
    return rows
