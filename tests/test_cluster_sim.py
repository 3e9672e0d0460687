"""The cluster simulator and the goodput planner (leapdecode/cluster/): workloads, step-cost models, exact small
cases, the simulator against the real engine on a virtual clock, and the planner choosing disaggregation where
prefill interference breaks a tight TPOT target and co-location where it does not.

No timing is asserted: every clock here is virtual."""
import math

import numpy as np
import pytest

from leapdecode.cluster.planner import Planner
from leapdecode.cluster.simulator import (Cluster, Colocated, Disaggregated, EngineShape, goodput, simulate)
from leapdecode.cluster.step_model import (H100_SXM, LLAMA3_8B, StepCost, StepShape, measure, roofline)
from leapdecode.cluster.validation import compare, run_engine, validate_against_engine
from leapdecode.cluster.workload import SLO, Fixed, LogNormal, SimRequest, Uniform, Workload

from conftest import make_llm


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's forwards are microseconds of work: on a busy 2-core machine a second torch thread only
    spins (a 0.3 s run took 23 s with two threads under load)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- workloads ---------------------------------------------------------------------------------------------------
def test_workload_is_deterministic_and_the_rate_only_stretches_the_clock():
    w = Workload(rate=4.0, input=LogNormal(300, 0.9, 8, 2000), output=Uniform(4, 64), num_requests=50, seed=7)
    a, b = w.requests(), w.requests()
    assert a == b and len(a) == 50 and a[0].arrival == 0.0
    assert all(8 <= r.prompt_len <= 2000 and 4 <= r.output_len <= 64 for r in a)
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    assert Workload(rate=4.0, input=w.input, output=w.output, num_requests=50, seed=8).requests() != a
    fast = w.at_rate(8.0).requests()
    assert [(r.prompt_len, r.output_len) for r in fast] == [(r.prompt_len, r.output_len) for r in a]
    assert all(math.isclose(f.arrival, r.arrival / 2) for f, r in zip(fast, a))
    uniform = Workload(rate=2.0, arrival="uniform", pairs=[(5, 2), (7, 3)], num_requests=3).requests()
    assert uniform == [SimRequest(0.0, 5, 2, 0), SimRequest(0.5, 7, 3, 1), SimRequest(1.0, 5, 2, 2)]
    with pytest.raises(ValueError):
        Workload(rate=0)


# -- step models -------------------------------------------------------------------------------------------------
def test_step_cost_fit_recovers_known_coefficients():
    truth = StepCost(c0=2e-3, c_token=3e-5, c_seq=4e-4, c_kv=2e-7, c_pair=5e-9)
    rng = np.random.default_rng(0)
    shapes = [StepShape.prefill(int(n), int(s)) for n, s in zip(rng.integers(2, 512, 20), rng.integers(0, 1024, 20))]
    shapes += [StepShape.decode(int(b), int(c)) for b, c in zip(rng.integers(1, 64, 20), rng.integers(2, 4096, 20))]
    shapes += [StepShape.of_chunks([(100, 1)] * int(b) + [(0, int(n))]) for b, n in zip(range(1, 9), range(8, 200, 24))]
    fit = StepCost.fit([(s, truth(s)) for s in shapes])
    for name in ("c0", "c_token", "c_seq", "c_kv", "c_pair"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    # a term the data does not need comes out zero, never negative
    no_pairs = StepCost(c0=1e-3, c_token=1e-5)
    fit = StepCost.fit([(s, no_pairs(s)) for s in shapes])
    assert all(v >= 0 for v in vars(fit).values())
    assert fit.c_pair == pytest.approx(0, abs=1e-15) and fit.c_token == pytest.approx(1e-5, rel=1e-6)


def test_step_shape_of_a_mixed_step():
    s = StepShape.of_chunks([(99, 1), (40, 1), (0, 16), (16, 8)])
    assert (s.prefill_tokens, s.prefill_seqs, s.decode_seqs, s.tokens, s.seqs) == (24, 2, 2, 26, 4)
    assert s.kv_tokens == 100 + 41 + 16 + 24
    assert s.attn_pairs == 100 + 41 + 16 * 17 // 2 + (8 * 16 + 8 * 9 // 2)


def test_roofline_figures_for_llama3_8b_on_h100_are_sane():
    m, h = LLAMA3_8B, H100_SXM
    assert m.kv_bytes_per_token == 131072                                 # 2 * 32 layers * 8 heads * 128 * 2 bytes
    assert m.matmul_params == pytest.approx(6.98e9, rel=0.01)
    tp1, tp2 = roofline(m, h, 1), roofline(m, h, 2)
    d1 = StepShape.decode(1, 1024)
    # batch-1 decode reads ~15 GB of weights at 0.8 x 3.35 TB/s: 5.6 ms, + 1 ms of host overhead
    assert 5e-3 < tp1(d1) < 9e-3 and tp1.memory_s(d1) > 10 * tp1.compute_s(d1)
    d64 = StepShape.decode(64, 2048)                                        # still bandwidth-bound at batch 64
    assert tp1.memory_s(d64) > tp1.compute_s(d64) and tp1(d64) < 20e-3
    p = StepShape.prefill(2048)                                             # 2 * 7e9 * 2048 FLOPs at 0.6 x 989 TFLOP/s
    assert tp1.compute_s(p) > tp1.memory_s(p) and 40e-3 < tp1(p) < 70e-3
    assert tp2(d1) < tp1(d1) and tp2(p) < tp1(p) and tp2.comm_s(p) > 0 == tp1.comm_s(p)
    assert 3e5 < tp1.kv_capacity_tokens() < 5e5 and tp2.kv_capacity_tokens() > 2 * tp1.kv_capacity_tokens()
    with pytest.raises(ValueError):
        roofline(m, h, 3)


# -- the simulator, by hand --------------------------------------------------------------------------------------
COST = StepCost(c0=0.010, c_token=0.001)       # a step of n tokens takes 10 + n ms


def test_colocated_two_requests_exactly():
    cluster = Cluster({1: COST}, engine=EngineShape(block_size=4, num_blocks=64, max_model_len=64))
    a, b = SimRequest(0.0, 8, 3, 0), SimRequest(0.020, 8, 2, 1)
    res = simulate(Colocated(), cluster, [a, b])
    # t=0: a's prompt (8 tokens, 18 ms) -> a's 1st token at .018; b arrives during a's decode (.018 -> .029);
    # .029: a decodes + b's prompt (9 tokens, 19 ms) -> a's 3rd token and b's 1st at .048; b decodes -> .059
    ra, rb = res.results
    assert (ra.first_token, ra.finish) == pytest.approx((0.018, 0.048))
    assert (rb.first_token, rb.finish) == pytest.approx((0.048, 0.059))
    assert (ra.ttft, ra.tpot, rb.ttft, rb.tpot) == pytest.approx((0.018, 0.015, 0.028, 0.011))
    assert res.num_steps == 4 and res.complete and res.num_preemptions == 0


def test_disaggregated_request_exactly_with_the_kv_transfer_and_the_imported_prefix():
    cluster = Cluster({1: COST}, engine=EngineShape(block_size=4, num_blocks=64, max_model_len=64),
                      kv_bytes_per_token=1000, link_bandwidth=1e6, transfer_latency_s=0.001)
    res = simulate(Disaggregated(1, 1, 1, 1), cluster, [SimRequest(0.0, 8, 3, 0)])
    # prefill 8 tokens -> 1st token at .018; 8 KB at 1 MB/s + 1 ms -> on the decode instance at .027; its two full
    # blocks are adopted, only the first token is computed (11 ms) -> 2nd token .038, 3rd .049
    (r,) = res.results
    assert (r.first_token, r.finish) == pytest.approx((0.018, 0.049))
    assert res.num_steps == 3
    # the same with no block to import (a 3-token prompt): the decode instance computes prompt + first token
    res = simulate(Disaggregated(1, 1, 1, 1), cluster, [SimRequest(0.0, 3, 2, 0)])
    assert res.results[0].finish == pytest.approx(0.013 + 0.004 + 0.014)


def test_simulation_stops_once_the_slo_verdict_is_certain():
    cluster = Cluster({1: COST}, engine=EngineShape(block_size=4, num_blocks=256, max_model_len=128))
    reqs = Workload(rate=1000.0, input=Fixed(32), output=Fixed(8), num_requests=40).requests()
    full = simulate(Colocated(), cluster, reqs)
    strict = SLO(ttft_s=0.05, tpot_s=1.0)
    assert full.attainment(strict) < 0.9
    early = simulate(Colocated(), cluster, reqs, slo=strict, decide=True)
    assert early.passed is False and not early.complete and early.num_steps < full.num_steps
    assert simulate(Colocated(), cluster, reqs, slo=SLO(10.0, 10.0), decide=True).passed is True


# -- the simulator against the real engine -----------------------------------------------------------------------
@pytest.mark.parametrize("kv", [{}, {"kv_cache_dtype": "int8", "kv_cache_recent_tokens": 32}], ids=["auto", "int8"])
def test_simulator_reproduces_a_real_engine_run_on_a_virtual_clock(tiny_dir, kv):
    """Same scheduler, same clock: the simulated TTFT and TPOT of every request equal the real engine's (the
    stated tolerance is 1e-9 s, float summation order). The pool is small enough that requests get preempted; a
    quantized cache's full-precision window (recent tokens included) is modelled too."""
    llm = make_llm(tiny_dir("llama"), max_num_batched_tokens=48, max_num_seqs=4, num_kv_blocks=20, **kv)
    cost = StepCost(c0=2e-3, c_token=1e-4, c_seq=3e-4, c_kv=1e-6, c_pair=1e-8)
    reqs = Workload(rate=40.0, input=Uniform(8, 110), output=Uniform(2, 30), num_requests=24, seed=3).requests()
    real = run_engine(llm, reqs, cost)
    sim = simulate(Colocated(), Cluster({1: cost}, engine=EngineShape.of_llm(llm)), reqs)
    assert real.num_preemptions > 0 and real.num_preemptions == sim.num_preemptions
    assert real.num_steps == sim.num_steps
    for r, s in zip(real.results, sim.results):
        assert r.request == s.request
        assert r.first_token == pytest.approx(s.first_token, abs=1e-9)
        assert r.finish == pytest.approx(s.finish, abs=1e-9)
    for row in compare(real, sim, (50, 90)):
        assert row["simulated_s"] == pytest.approx(row["measured_s"], abs=1e-9), row["metric"]
    assert not llm.engine.has_unfinished()


def test_step_cost_measured_on_the_real_engine_and_the_wall_clock_validation_runs(tiny_dir):
    """Smoke test of the measurement and of the benchmark's validation: shapes and rows, no timing asserted."""
    llm = make_llm(tiny_dir("llama"), max_num_batched_tokens=64, max_num_seqs=4)
    samples = measure(llm, prompt_lens=(8, 48), prefill_batches=(1, 2), decode_batches=(1, 3), contexts=(16,),
                      decode_steps=2, repeats=1)
    shapes = [s for s, _ in samples]
    assert StepShape.prefill(48) in shapes and StepShape.prefill(8, seqs=2) in shapes
    assert any(s.decode_seqs == 3 and s.prefill_tokens == 0 for s in shapes)
    assert all(t > 0 for _, t in samples)
    cost = StepCost.fit(samples)
    assert cost(StepShape.decode(1, 16)) > 0
    rows = validate_against_engine(llm, Workload(rate=50.0, input=Uniform(8, 40), output=Fixed(4), num_requests=6),
                                   cost)
    assert [r["metric"] for r in rows][:5] == ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "steps"]
    assert all(r["measured_s"] > 0 and r["simulated_s"] > 0 for r in rows[:5])
    assert rows[-1]["metric"].startswith("step time, this run") and rows[-1]["error"] >= 0
    assert not llm.engine.has_unfinished()


# -- disaggregation against co-location --------------------------------------------------------------------------
# A hand-made device: 5 ms per step, 50 us per token (a 512-token prefill chunk: ~31 ms), 10 ns per KV token read.
DEVICE = StepCost(c0=5e-3, c_token=5e-5, c_kv=1e-8)
SMALL = Cluster({1: DEVICE}, engine=EngineShape(block_size=16, max_num_batched_tokens=512, max_num_seqs=64,
                                                max_model_len=4096, num_blocks=4096),
                kv_bytes_per_token=1e4, link_bandwidth=1e11)


def test_disaggregation_wins_with_long_prompts_under_a_tight_tpot():
    """DistServe's case: every prefill chunk that rides in a co-located step stretches the decodes in it (31 ms
    against a 7 ms TPOT), while a decode instance never sees one."""
    work = Workload(input=Fixed(1024), output=Fixed(24), num_requests=60)
    slo = SLO(ttft_s=0.4, tpot_s=0.007)
    co = goodput(Colocated(), SMALL, work, slo, rtol=0.1)
    dis = goodput(Disaggregated(3, 1, 1, 1), SMALL, work, slo, rtol=0.1)
    assert dis.per_device > 1.5 * co.per_device
    plan = Planner(SMALL, work, slo, max_unit=4).plan(4)
    assert plan.best.kind == "disaggregated" and plan.best.simulated
    assert any(c.kind == "colocated" and c.simulated for c in plan.candidates)
    assert plan.best.per_device > max(c.per_device for c in plan.candidates if c.kind == "colocated")


def test_colocation_wins_with_short_prompts():
    """Short prompts under a looser TPOT: a co-located step hardly notices them, and a disaggregated unit keeps a
    device for prefill that short prompts do not need."""
    work = Workload(input=Fixed(32), output=Fixed(24), num_requests=60)
    slo = SLO(ttft_s=0.4, tpot_s=0.02)
    plan = Planner(SMALL, work, slo, max_unit=4).plan(4)
    assert plan.best.kind == "colocated"
    assert any(c.kind == "disaggregated" and c.simulated for c in plan.candidates)
    assert plan.best.per_device > max(c.per_device for c in plan.candidates if c.kind == "disaggregated")
