"""The speculation controller against fabricated machines: step-time curves (CPU-like, where every verified token
costs; GPU-like, flat until a knee) and acceptance histories, driven through the real Speculator (its shadow drafts
included) without a model. Asserts the chosen draft sizes and the tokens per second it reaches, against plain
decoding and fixed draft sizes on the same fabricated machine."""
import random

import numpy as np
import pytest
import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.spec.controller import MARGINAL_CAP, Controller, StepTimeModel
from leapdecode.spec.drafter import Draft, DraftRequest
from leapdecode.spec.speculator import Speculator


def cpu_like(n):        # a small model on a CPU: a multi-token forward costs a jump, then every token costs
    return 0.010 + (0.004 if n > 1 else 0.0) + 0.0015 * (n - 1)


def cpu_heavy(n):       # compute-bound: a token costs almost as much as a step
    return 0.001 + 0.009 * n


def gpu_like(n):        # memory-bound until a knee at 256 tokens
    return 0.008 + 0.00002 * n + (0.0001 * (n - 256) if n > 256 else 0.0)


def truth(seq_id, pos):
    return (seq_id * 1_000_003 + pos * 7919) % 50_000


class Seq:
    is_finished = False

    def __init__(self, seq_id, prompt_len=16):
        self.seq_id, self.num_prompt_tokens = seq_id, prompt_len
        self.token_ids = [truth(seq_id, p) for p in range(prompt_len)]
        self.params, self.index, self.block_table = None, 0, []


def commit(spec, seqs, drafts) -> int:
    """Each sequence commits the accepted prefix of its draft (sample-then-match against ``truth``) and the bonus
    token, and the speculator observes it. Returns the tokens committed."""
    tokens = 0
    for s in seqs:
        d = drafts.get(s.seq_id)
        pos = len(s.token_ids)
        acc = d.accepted_length([truth(s.seq_id, pos + j) for j in range(len(d))]) if d else 0
        s.token_ids += [truth(s.seq_id, pos + j) for j in range(acc + 1)]
        tokens += acc + 1
        spec.observe(s, len(d) if d else 0, acc, None)
    return tokens


class FakeDrafter:
    """Drafts the true continuation; each next token is right with probability ``self.q`` (a geometric chain).
    ``claim``: the drafts carry calibrated confidences that say each token is right with this probability."""

    def __init__(self, q, seed=0, claim=None):
        self.q, self.rng, self.claim = q, random.Random(seed), claim
        self.calls = 0

    def propose(self, requests):
        self.calls += len(requests)
        out = []
        for r in requests:
            toks, ok = [], True
            for j in range(r.max_draft):
                ok = ok and self.rng.random() < self.q
                t = truth(r.seq_id, len(r.token_ids) + j)
                toks.append(t if ok else t + 1)
            claim = self.q if self.claim == "q" else self.claim        # "q": claims that track the real rate
            conf = [claim ** (j + 1) for j in range(len(toks))] if claim is not None else None
            out.append(Draft(toks, None, score=0.5, confidence=conf))
        return out

    def observe(self, *a, **k):
        pass

    def finish(self, *a, **k):
        pass


def probed_model(probe=cpu_like):
    """A step-time model holding a start-up probe (forwards of 1..64 tokens) as its shape, as the engine makes it."""
    st = StepTimeModel()
    for n in (1, 2, 4, 8, 16, 64, 1, 64):
        st.observe(n, probe(n))
    return st


def timed_at_batch_1(curve, sizes=5):
    """A probed step-time model whose decode steps of 1..``sizes`` tokens at batch 1 have each been timed five
    times (no size is thinly timed, so the controller does not try one to time it: ``Controller._thin``)."""
    st = probed_model(curve)
    for _ in range(5):
        for n in range(1, sizes + 1):
            st.observe(n, curve(n), num_seqs=1)
    return st


DRAFT_SECONDS = 20e-6     # fabricated drafting time per request (the fake drafter's real time depends on the load)


def fabricated_drafting(spec, per_request=DRAFT_SECONDS, slow=None):
    """The speculator charges drafting by the wall clock; replace it by ``per_request`` seconds per request, so
    that what a test asserts does not depend on how loaded the machine running it is. ``slow``: {call number
    (from 1): its seconds instead}."""
    calls = [0]

    def draft(reqs):
        calls[0] += 1
        dt = (slow or {}).get(calls[0], per_request * len(reqs))
        return spec._account(spec.drafter.propose(reqs), dt)
    spec._draft = draft
    return spec


def simulate(step_time, q, batch=1, steps=300, k=8, adaptive=True, noise=0.03, q_after=None, switch=None, seed=0,
             probe_time=None, graphs=None, spike=None, wrong=False, guard=True, draft_seconds=DRAFT_SECONDS,
             turnover=None, claim=None, slow_drafts=None):
    """Run the speculator on a fabricated machine; returns (tokens/s, draft tokens per request per step).
    ``probe_time``: what the start-up probe measures (default: the machine's own curve). ``graphs``: a CUDA-graph
    machine, (bucket(num_seqs, q) -> (B, Q) or None, real seconds of a bucket, its replay time at start-up):
    steps a bucket holds cost the bucket's time, whatever their token count. ``spike``: (every, seconds), a cost every so many
    verifying steps (a collection set off by draft allocations, a drafter's periodic rebuild): the median of a
    size's recent steps, the controller's cost model, never sees it. ``wrong``: a controller that always keeps
    every draft (a cost model that is wrong); ``guard``: the measured throughput guard on; ``draft_seconds``: what
    drafting costs per request; ``turnover``: every so many steps the oldest request ends and a new one arrives;
    ``claim``: the drafts' calibrated confidence per token (None: none); ``slow_drafts``: {drafting call number
    (from 1): its seconds instead}."""
    drafter = FakeDrafter(q, seed, claim)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=adaptive, drafter=drafter)
    probe = probed_model(probe_time or step_time)
    spec = fabricated_drafting(Speculator(cfg, 50_000, probe), draft_seconds, slow_drafts)
    if wrong:
        spec.controller.draft_lengths = lambda proposals, *a, **k: [p[1] for p in proposals]
    if not guard:
        spec.guard = None
    if graphs is not None:
        bucket_of, bucket_seconds, replay_seconds = graphs
        for b in {bucket_of(batch, x) for x in range(1, k + 2)} - {None}:
            probe.graphs.set_prior(b, replay_seconds(b))
        if spec.controller is not None:
            spec.controller.graph_bucket = bucket_of
    rng = random.Random(seed + 1)
    seqs = [Seq(i) for i in range(batch)]
    seconds, tokens, per_step, spiky = 0.0, 0, [], 0
    for step in range(steps):
        if switch is not None and step == switch:
            drafter.q = q_after
        if turnover and step and step % turnover == 0:
            spec.finish(seqs.pop(0))
            seqs.append(Seq(max(s.seq_id for s in seqs) + 1))
        drafted_before, tokens_before = spec.drafter_seconds, tokens
        drafts = spec.propose(seqs, [k] * batch, 0)
        drafting = spec.drafter_seconds - drafted_before        # drafting is on the step's critical path
        seconds += drafting
        n = batch + sum(len(d) for d in drafts.values())
        tokens += commit(spec, seqs, drafts)
        bucket = graphs[0](batch, 1 + max((len(d) for d in drafts.values()), default=0)) if graphs else None
        t = (graphs[1](bucket) if bucket else step_time(n)) * (1 + noise * (2 * rng.random() - 1))
        if spike and n > batch:
            spiky += 1
            t += spike[1] if spiky % spike[0] == 0 else 0.0
        seconds += t
        spec.observe_step(n, drafting + t, bucket, tokens - tokens_before)
        per_step.append((n - batch) / batch)
    return tokens / seconds, per_step, spec


def plain_rate(step_time, batch=1):
    return batch / step_time(batch)


@pytest.mark.parametrize("step_time,q", [(cpu_heavy, 0.6), (cpu_like, 0.3), (gpu_like, 0.0)])
def test_no_speculation_when_it_cannot_pay(step_time, q):
    rate, per_step, spec = simulate(step_time, q)
    assert np.mean(per_step[-100:]) < 0.3                 # nearly always k = 0 (exploration aside)
    assert rate >= 0.97 * plain_rate(step_time)
    assert spec.num_proposals < 60                        # the drafter is mostly asked for shadows only


@pytest.mark.parametrize("step_time,q,batch,min_speedup", [(cpu_like, 0.85, 1, 1.3), (gpu_like, 0.7, 1, 1.8),
                                                            (gpu_like, 0.7, 64, 1.5)])
def test_speculates_when_it_pays_and_keeps_up_with_the_best_fixed_k(step_time, q, batch, min_speedup):
    rate, per_step, _ = simulate(step_time, q, batch=batch, steps=200)
    assert np.mean(per_step[-100:]) > 1
    assert rate >= min_speedup * plain_rate(step_time, batch)
    best_fixed = max(simulate(step_time, q, batch=batch, steps=200, k=k, adaptive=False)[0] for k in (1, 2, 4, 8))
    assert rate >= 0.85 * best_fixed


def test_cost_is_learned_from_observed_steps_not_the_probe():
    """The start-up probe says tokens are nearly free (a line through 1 and 64 tokens); the real machine has a
    jump at 2 tokens that makes drafting a loss: the controller must find out and stop."""
    drafter_q = 0.3

    def jumpy(n):
        return 0.010 if n == 1 else 0.019 + 0.0001 * n

    rate, per_step, _ = simulate(jumpy, drafter_q, steps=200)
    assert np.mean(per_step[-100:]) < 0.3
    assert rate >= 0.95 * plain_rate(jumpy)


def test_backs_off_within_a_few_steps_when_acceptance_drops_and_returns():
    _, per_step, _ = simulate(cpu_like, 0.95, steps=260, q_after=0.0, switch=100)
    assert np.mean(per_step[60:100]) > 2
    assert max(per_step[106:140]) == 0 or np.mean(per_step[106:140]) < 0.3
    # and comes back when the text copies again (learned from shadow drafts while speculation was off)
    _, per_step, _ = simulate(cpu_like, 0.0, steps=260, q_after=0.95, switch=100)
    assert np.mean(per_step[60:100]) < 0.3
    assert np.mean(per_step[200:]) > 2


def test_calibrated_claims_back_off_and_return():
    """The same with calibrated drafts whose claims track the real rate: the quiet re-check values each request by
    its drafter's latest draft (shadow drafts included), so low claims keep it quiet and high ones bring it back."""
    _, per_step, _ = simulate(cpu_like, 0.95, steps=260, q_after=0.0, switch=100, claim="q")
    assert np.mean(per_step[60:100]) > 2
    assert np.mean(per_step[110:140]) < 0.3
    _, per_step, _ = simulate(cpu_like, 0.0, steps=260, q_after=0.95, switch=100, claim="q")
    assert np.mean(per_step[60:100]) < 0.3
    assert np.mean(per_step[200:]) > 2


def test_quiet_recheck_values_requests_as_their_drafts_are_valued(monkeypatch):
    """While speculation is off, the re-check (`worth_drafting`) valued each request by its drafter score alone,
    while the drafts themselves are valued by their calibrated confidences: where the two disagreed (here: good
    acceptance so far, drafts that claim little), every quiet re-check said "worth it", the whole batch was
    drafted and nothing was chosen (at batch 64 on the CPU: on every step). The re-check now goes by the
    confidences of the request's latest draft, so the batch is not drafted again for nothing."""
    full = []
    real = FakeDrafter.propose
    monkeypatch.setattr(FakeDrafter, "propose", lambda self, reqs: full.append(len(reqs) == 16) or real(self, reqs))
    _, per_step, _ = simulate(cpu_like, 0.9, batch=16, steps=300, claim=0.05)
    assert sum(per_step) == 0
    assert sum(full) <= 3, sum(full)


def test_draft_lengths_choose_by_value_and_cost():
    st = StepTimeModel()
    for n in range(1, 40):
        st.observe(n, cpu_like(n))
    ctl = Controller(8, st)
    for _ in range(10):
        ctl.observe(1, 8, 8)       # request 1: everything accepted
        ctl.observe(2, 8, 0)       # request 2: nothing
    keep = ctl.draft_lengths([(1, 8, 0.5), (2, 8, 0.5)], other_tokens=2)
    assert keep[0] >= 6 and keep[1] == 0
    flat = StepTimeModel()
    for n in range(1, 40):
        flat.observe(n, gpu_like(n))
    for outcome in [0, 0, 1] * 4:
        ctl.observe(3, 8, outcome)   # request 3: a long shot (one draft in three has its first token accepted)
    assert ctl.draft_lengths([(3, 8, 0.5)], other_tokens=1) == [0]
    ctl.step_time = flat            # on a flat machine even a long shot is worth verifying
    assert ctl.draft_lengths([(3, 8, 0.5)], other_tokens=1)[0] > 0
    st2 = StepTimeModel()
    for n in range(1, 40):
        st2.observe(n, cpu_heavy(n))
    ctl2 = Controller(8, st2)
    for _ in range(5):
        ctl2.observe(1, 8, 8)
    assert ctl2.draft_lengths([(1, 8, 0.5)], other_tokens=1)[0] < 8   # each token costs ~ a step


def test_step_time_model_follows_a_knee_and_is_robust_to_outliers():
    st = StepTimeModel()
    for _ in range(3):
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            st.observe(n, gpu_like(n))
    st.observe(8, 1.0)                                      # a garbage-collection pause
    for n in (3, 8, 100, 300, 700):
        assert st(n) == pytest.approx(gpu_like(n), rel=0.1), n
    assert st(1) <= st(2) <= st(300)


def test_probe_is_the_shape_and_real_steps_set_the_scale():
    """The start-up probe runs over an empty cache; real steps at batch 16 cost twice as much (long contexts). The
    cost of extra tokens must be the probe's shape scaled to the real steps, not a line from the real 16-token
    step to the probe's cheap 64-token one (which made extra tokens look nearly free)."""
    st = probed_model()
    Controller(8, st)                       # the controller takes what the model holds as the prior shape
    for _ in range(5):
        st.observe(16, 2 * cpu_like(16))
    for n in (17, 24, 40, 64, 100):
        assert st(n) == pytest.approx(2 * cpu_like(n), rel=0.05), n
    marginal = st(24) - st(16)
    assert marginal == pytest.approx(2 * (cpu_like(24) - cpu_like(16)), rel=0.1)


def test_no_loss_at_batch_16_when_real_steps_cost_more_than_the_probe():
    """Batch 16 on a machine whose real steps cost 2x the probe's: drafts with a 45% first-token hit rate do not
    pay (each verified token costs ~4% of a step), and the controller must not be fooled into drafting by the
    probe's cheaper points (with the probe mixed in as measurements: 0.27 draft tokens per request per step over
    the first 50 steps, 0.964x plain)."""
    def real(n):
        return 2 * cpu_like(n)
    rate, per_step, _ = simulate(real, 0.45, batch=16, steps=150, probe_time=cpu_like)
    assert np.mean(per_step[:50]) < 0.1                   # from the first steps on, not after learning the hard way
    assert rate >= 0.985 * plain_rate(real, 16)


def test_decode_steps_are_priced_per_batch_size_not_by_token_count_alone():
    """Steps with prefill chunks are cheap per token (their rows skip the LM head and per-sequence work), 64
    decodes are not: 92 tokens as a prompt chunk cost what 64 decodes do. Priced by token count alone, 28 draft
    tokens on 64 decodes looked free (at batch 64 on the CPU speculation lost 8-16%); priced on the curve of
    64-sequence steps they cost what they do, and drafts worth half a token each do not pay."""
    def decodes64(n):           # the CPU trace: 64 decodes 200 ms, each draft token ~1.6 ms more
        return 0.200 + 0.0016 * (n - 64)

    def machine(one_curve):
        st = probed_model()
        ctl = Controller(8, st)
        for _ in range(5):
            for n in (92, 150, 300):
                st.observe(n, 0.060 + 0.0015 * n)        # prompt chunks with a few decodes
            st.observe(64, decodes64(64), num_seqs=None if one_curve else 64)
        return st, ctl

    st, ctl = machine(one_curve=False)
    assert st(92) == pytest.approx(0.060 + 0.0015 * 92, rel=0.05)          # a mixed step: the mixed steps' curve
    assert st(92, num_seqs=64) >= decodes64(92)                            # 64 decodes and 28 draft tokens
    proposals = [(i, 1, 0.5, [0.5]) for i in range(64)]
    assert sum(ctl.draft_lengths(proposals, 64, num_seqs=64)) == 0
    st, ctl = machine(one_curve=True)                    # every step on one token-count curve, as before
    assert st(92, num_seqs=64) < 0.85 * decodes64(92)
    assert sum(ctl.draft_lengths(proposals, 64, num_seqs=64)) > 0


def test_beyond_the_steps_seen_a_draft_token_costs_a_few_times_the_probes_not_the_whole_ratio():
    """Real decode steps at batch 64 cost 15x the probe's step (attention over long contexts), but a draft token
    adds little of that (measured: ~1-4x the probe's extra token, ``MARGINAL_CAP``). Holding the whole ratio priced
    draft tokens 15x too high and speculation could never be tried at that batch size."""
    st = probed_model()
    Controller(8, st)
    for _ in range(3):
        st.observe(64, 15 * cpu_like(64), num_seqs=64)
    assert st(64, 64) == pytest.approx(15 * cpu_like(64))
    assert st(164, 64) - st(64, 64) == pytest.approx(MARGINAL_CAP * (cpu_like(164) - cpu_like(64)), rel=0.02)
    for _ in range(3):                                    # a real step further out: its own price
        st.observe(164, 15 * cpu_like(64) + 0.3, num_seqs=64)
    assert st(164, 64) == pytest.approx(15 * cpu_like(64) + 0.3)
    assert st(64, 64) < st(114, 64) < st(164, 64)


def test_claims_are_scaled_by_how_often_they_came_true():
    """A drafter whose calibrated confidences claim 0.9 per token when 0.3 is the truth (a fresh drafter trusts its
    own guesses): at batch 16 on a CPU-like machine such drafts pay only if the claims were true. The controller
    measures accepted over claimed tokens and values later claims by it, so it stops drafting within a few steps;
    taking the claims at their word it drafts all along and runs below plain decoding."""
    def real(n):
        return 2 * cpu_like(n)
    rate, per_step, spec = simulate(real, 0.3, batch=16, steps=200, claim=0.9)
    assert spec.controller.realized < 0.5
    assert np.mean(per_step[50:]) < 0.2
    assert rate >= 0.97 * plain_rate(real, 16)


def test_claims_come_true_again_in_shadow():
    """The discount on claims is measured on shadow drafts too: after a spell of failing drafts speculation stops,
    and only shadows still show whether the claims come true. (Measured on verified drafts alone, at batch 1 on
    the CPU speculation stayed off for good on HumanEval: 1.01 tokens per step against 1.56-1.66 with shadows.)"""
    st = StepTimeModel()
    for n in range(1, 40):
        st.observe(n, gpu_like(n))                        # verifying is nearly free: every draft is kept
    ctl = Controller(8, st)
    for step in range(30):                                # claims of 0.9 per token that all fail
        keep = ctl.draft_lengths([(1, 4, 0.5, [0.9, 0.81, 0.73, 0.66])], 1)
        assert keep == [4] or step >= 2                   # (then the run of failures says stop: _claimed_values)
        ctl.observe(1, 4, 0, claimed=None if keep[0] else [0.9, 0.81, 0.73, 0.66])
    assert ctl.realized < 0.2
    for step in range(60):                                # then shadows: the same claims, all accepted
        ctl.observe(1, 4, 4, claimed=[0.9, 0.81, 0.73, 0.66])
    assert ctl.realized > 0.95


def test_a_stale_plain_price_is_measured_again_before_a_modest_gain_is_trusted():
    """Plain decoding at a batch size is timed again when new requests came in (a step with prefill chunks) since
    it was last seen: their contexts set its cost. A controller that speculates never times a plain step otherwise,
    and at batch 64 on the CPU the old price (254 ms, the previous requests') against the real one (165 ms) made
    speculation that lost 22% look like a gain. Below ``STALE_BATCH`` a large predicted gain does not wait (a
    step there is mostly weights, not contexts); from it on every gain waits."""
    for batch, large_waits in ((4, False), (16, True)):
        st = probed_model()
        ctl = Controller(8, st)
        for _ in range(3):
            st.observe(batch, 0.300, num_seqs=batch)          # decodes over long contexts
        for _ in range(12):
            st.observe(2 * batch, 0.348, num_seqs=batch)      # speculating steps: one draft token each
        assert not st.stale(batch, batch)
        st.observe(400, 0.6)                                  # a prompt chunk: new requests
        assert st.stale(batch, batch)
        modest = [(i, 1, 0.5, [0.5]) for i in range(batch)]   # predicted: ~1.3x
        assert ctl.draft_lengths(modest, batch, num_seqs=batch) == [0] * batch and ctl.last_choice["explored"]
        large = [(i, 4, 0.5, [0.99] * 4) for i in range(batch)]   # ~3x
        assert (sum(ctl.draft_lengths(large, batch, num_seqs=batch)) == 0) == large_waits, batch
        st.observe(batch, 0.300, num_seqs=batch)              # timed again: the modest gain is taken
        assert not st.stale(batch, batch)
        assert sum(ctl.draft_lengths(modest, batch, num_seqs=batch)) > 0


def test_a_plain_step_never_timed_at_a_large_batch_is_stale_once_new_requests_came():
    """At batch 64 on the CPU the controller drafted from its first decode steps, so plain decoding at that batch
    was priced from its speculating steps of earlier requests (400 ms against 180 ms measured): a gain of 2.3x was
    predicted and 0.88x realized. A plain step never timed at a batch size of at least ``STALE_BATCH`` is stale
    when every step seen there predates the newest requests; before any step there (nothing to distrust: the
    start-up probe prices it) and below ``STALE_BATCH`` it is not."""
    st = probed_model()
    assert not st.stale(64, 64)                               # no step at 64 yet: the probe's price stands
    for _ in range(5):
        st.observe(190, 0.40, num_seqs=64)                    # speculating steps only
    assert not st.stale(64, 64)
    st.observe(500, 0.6)                                      # new requests
    assert st.stale(64, 64)
    for _ in range(5):
        st.observe(8, 0.04, num_seqs=4)
    st.observe(500, 0.6)
    assert not st.stale(4, 4)                                 # a small batch: priced by what it has
    st.observe(180, 0.38, num_seqs=64)                        # a step of the new requests at 64
    assert not st.stale(64, 64)


def test_a_large_batch_prices_drafts_by_the_newest_requests_steps_only():
    """At batch 64 on the CPU the previous requests' cheap speculating steps (short contexts) sat on the curve beside
    a fresh, dearer plain step of the new ones: the curve, kept non-decreasing, priced every draft token at nothing,
    and drafts that lost ~9% were taken. From ``STALE_BATCH`` on, once the new requests have a step of their own,
    only such steps price the batch size (beyond them, the probe's extra cost, scaled)."""
    st = probed_model()
    st.mark_prior()                                           # (what a Controller does with it)
    for _ in range(5):
        st.observe(64, 0.18, num_seqs=64)                     # the previous requests: plain ...
        st.observe(190, 0.22, num_seqs=64)                    # ... and speculating steps
    st.observe(600, 0.9)                                      # new requests (long contexts)
    for _ in range(3):
        st.observe(64, 0.40, num_seqs=64)                     # their plain step
    extra = st(190, num_seqs=64) - st(64, num_seqs=64)
    probe_extra = st._prior_at(np.array([190.0]))[0] - st._prior_at(np.array([64.0]))[0]
    assert extra >= probe_extra > 0, (extra, probe_extra)
    st.observe(190, 0.70, num_seqs=64)                        # their own speculating step: it prices drafts now
    assert abs(st(190, num_seqs=64) - 0.70) < 1e-9
    # below STALE_BATCH a batch size keeps every step it saw (a step there is mostly weights, not contexts)
    for _ in range(5):
        st.observe(4, 0.05, num_seqs=4)
        st.observe(12, 0.055, num_seqs=4)
    st.observe(600, 0.9)
    st.observe(4, 0.06, num_seqs=4)
    assert abs(st(12, num_seqs=4) - 0.055) < 1e-9            # the previous requests' 12-token step still prices it


def test_a_draft_that_doubles_the_step_must_show_more_than_one_that_adds_little():
    """The bar a draft clears grows with the extra step time it predicts (``Controller.risk``): the models err in
    proportion to what they extrapolate (at batch 64 on the CPU drafts that doubled the step were predicted to
    gain 1.2-1.3x and realized 0.9-1.0x). An 8% predicted gain is taken when it costs 10% more step time, not when
    it costs 85% more."""
    def chosen(step_cost_ratio):
        st = StepTimeModel()
        for n in range(1, 200):
            st.observe(n, 0.1 * (1 + (step_cost_ratio - 1) * max(0, n - 64) / 64))   # 64 more tokens: the ratio
        ctl = Controller(1, st)
        claim = 1.08 * step_cost_ratio - 1.0             # 64 drafts of this claim predict an 8% gain
        return sum(ctl.draft_lengths([(i, 1, 0.5, [claim]) for i in range(64)], 64, num_seqs=None))
    assert chosen(1.1) == 64
    assert chosen(1.85) == 0


def test_a_pending_shadow_draft_given_up_still_counts_what_it_matched():
    """A shadow draft is resolved at its first mismatch, while one that keeps matching waits: given up unscored
    (a real draft replaced it, the request ended), only the failures were counted, and with every request
    shadowed at once the controller learned that depth 2 was never accepted (speculation at batch 64 on a
    GPU-like machine settled at 1.7 draft tokens per request where 3 pay)."""
    from leapdecode.spec.tree import DraftTree
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=FakeDrafter(1.0))
    spec = Speculator(cfg, 50_000, probed_model())
    seq = Seq(7)
    start = len(seq.token_ids)
    spec._shadow[7] = (DraftTree.of([truth(7, start + j) for j in range(4)]), start, None, 0.5)
    seq.token_ids += [truth(7, start), truth(7, start + 1)]       # two plain steps: both matched, still pending
    spec.finish(seq)
    ctl = spec.controller
    assert ctl._g_first_acc[5] == 1.0 and ctl._g_first_n[5] == 1.0          # score 0.5's bucket
    assert ctl._g_depth_acc[2] == 1.0 and ctl._g_depth_n[3] == 0.0


def test_timing_plain_decoding_again_does_not_switch_speculation_off():
    """The plain step the controller runs to time plain decoding again is one step, not a verdict: speculation
    stays on for the next (switched off, at batch 1 every new request paid for a quiet spell and its shadow
    drafts, and the guard vetoed auto 12 times in a run where it had vetoed 2)."""
    st = probed_model()
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                            drafter=FakeDrafter(0.5, claim=0.5))
    spec = fabricated_drafting(Speculator(cfg, 50_000, st))
    spec.guard = None
    for _ in range(3):
        st.observe(16, 0.300, num_seqs=16)
    for _ in range(12):
        st.observe(32, 0.348, num_seqs=16)
    st.observe(400, 0.6)                                  # new requests: the plain price is stale
    seqs = [Seq(i) for i in range(16)]
    assert spec.propose(seqs, [1] * 16, 0) == {} and spec.controller.last_choice["explored"]
    assert spec.speculating


def test_off_controller_rechecks_rarely_not_every_step(monkeypatch):
    """While speculation is off the controller is asked again when something changed (a shadow draft resolved, the
    batch changed) or every 8 quiet steps, not on every step: the check costs ~0.5 ms (a CPU step's 10%; on a GPU,
    with a 4-layer model, this made adaptive draft_model 0.64x plain while drafting nothing)."""
    calls = []
    real = Controller.worth_drafting

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(Controller, "worth_drafting", counting)
    steps = 400
    _, per_step, spec = simulate(cpu_heavy, 0.0, steps=steps)
    assert sum(per_step) == 0                       # speculation never pays here: it stays off
    assert len(calls) < steps / 3, len(calls)


def test_step_time_excludes_the_drafters_own_time():
    """The engine reports a step's time from before drafting (so the host work drafts add is charged); the
    speculator takes the drafter's own time out, since the controller charges drafting apart."""
    import time as _time

    class SlowDrafter(FakeDrafter):
        def propose(self, requests):
            _time.sleep(0.05)
            return super().propose(requests)

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=SlowDrafter(0.9))
    spec = Speculator(cfg, 50_000, StepTimeModel())
    seqs = [Seq(0)]
    spec.propose(seqs, [4], 0)
    drafted = spec.drafter_seconds
    assert drafted >= 0.05
    spec.observe_step(5, drafted + 0.010)                   # 10 ms of step on top of the drafting
    assert spec.controller.step_time(5) == pytest.approx(0.010, abs=1e-6)


def test_online_training_time_is_not_charged_as_drafting():
    """A drafter that trains online (spec/online.py) reports that time apart (``last_train_seconds``): the
    controller's drafting charge and the shadow gap leave it out (a bounded, opted-into investment), or the
    controller would turn off the drafter that is learning; it is still drafter time, not step time."""
    import time as _time

    class TrainingDrafter(FakeDrafter):
        last_train_seconds = 0.0

        def propose(self, requests):
            out = super().propose(requests)
            t0 = _time.perf_counter()
            _time.sleep(0.05)                       # an optimizer step
            self.last_train_seconds = _time.perf_counter() - t0
            return out

    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=TrainingDrafter(0.9))
    spec = Speculator(cfg, 50_000, StepTimeModel())
    spec.propose([Seq(0)], [4], 0)
    assert spec.drafter_seconds >= 0.05 and spec.num_proposals == 1
    assert spec.draft_seconds_ema < 0.01, spec.draft_seconds_ema
    spec.observe_step(5, spec.drafter_seconds + 0.010)
    assert spec.controller.step_time(5) == pytest.approx(0.010, abs=1e-6)


def test_probe_times_each_size_after_an_untimed_first_forward():
    """The start-up probe must not time a size's first forward (one-off costs: allocations, oneDNN kernels made
    per shape): a first call of 80 ms per size must not show in the curve, whose true cost is 1 ms + 0.1 ms/token.
    Each forward is shaped as the steps the curve prices, a verification: logits for every row."""
    import time as _time
    from types import SimpleNamespace

    from leapdecode.engine.engine import Engine

    seen: set[int] = set()

    def execute(plan):
        n = plan.num_tokens
        assert len(plan.sample_logits_rows()) == n
        _time.sleep((0.08 if n not in seen else 0.0) + 0.001 + 0.0001 * n)
        seen.add(n)
        return SimpleNamespace(logits=torch.zeros(1))

    fake = SimpleNamespace(cfg=SimpleNamespace(block_size=16, max_num_batched_tokens=2048), max_model_len=2048,
                           device=torch.device("cpu"), runner=SimpleNamespace(execute=execute))
    model = Engine._probe_step_time(fake)
    for n in (1, 2, 4, 8, 16, 64):
        assert model(n) < 0.001 + 0.0001 * n + 0.04, (n, model(n))


# An H200 running a small model from CUDA graphs (benchmarks/results/h200-2026-11-27, the embedded 4-layer model at
# batch 1): the decode bucket's step 0.6 ms, the verification bucket (5 tokens) 0.75 ms whatever its fill, replays
# alone 0.3 / 0.35 ms; the start-up probe's eager forwards cost 1.0-1.1 ms up to 4 tokens and 2.8 ms at 8.
def h200_eager(n):
    return 0.0010 + 0.000025 * (n - 1) if n <= 4 else 0.0028 + 0.0002 * (n - 8)


def h200_bucket(num_seqs, q):
    return (num_seqs, 1) if q == 1 else (num_seqs, 5) if q <= 5 else None


H200_GRAPHS = (h200_bucket, lambda b: 0.0006 if b[1] == 1 else 0.00075, lambda b: 0.0003 if b[1] == 1 else 0.00035)


def test_graph_steps_are_priced_by_their_bucket_not_their_token_count():
    """Once a verification graph is paid for, its rows are filled: with acceptance ~0.9 the controller drafts all
    4 tokens. Priced by token count through the probe's eager curve (a 5-token step interpolated between the
    4- and 8-token forwards looks 1.5x a 4-token one), it drafted 3 and ran 1.6x slower than fixed k = 4 on the
    H200 (the run this machine is fabricated from)."""
    rate, per_step, spec = simulate(h200_eager, 0.95, k=4, steps=200, graphs=H200_GRAPHS)
    assert np.mean(per_step[-100:]) > 3.5
    fixed = simulate(h200_eager, 0.95, k=4, steps=200, graphs=H200_GRAPHS, adaptive=False)[0]
    assert rate >= 0.95 * fixed
    assert rate >= 2.5 * 1 / 0.0006                       # plain decoding: one token per 0.6 ms step
    # the step times went to the buckets, not to the token-count curve
    assert spec.controller.step_time.graphs((1, 5)) == pytest.approx(0.00075, rel=0.05)


def test_graph_times_fall_back_to_replay_time_plus_the_host_share():
    st = StepTimeModel()
    st.graphs.set_prior((1, 1), 0.0003)
    st.graphs.set_prior((1, 5), 0.00035)
    st.graphs.set_prior((64, 1), 0.0005)
    assert st.graphs((1, 5)) == pytest.approx(0.00035)          # nothing real seen yet: the replay alone
    st.observe(1, 0.0006, graph=(1, 1))
    assert st.graphs((1, 5)) == pytest.approx(0.00065)          # + the 0.3 ms the host added at batch 1
    st.observe(64, 0.0030, graph=(64, 1))
    assert st.graphs((64, 1)) == pytest.approx(0.0030)
    assert st.graphs((2, 1)) is None                            # no prior, never seen
    assert st.steps_since_seen(1, (1, 1)) == 1 and st.steps_since_seen(5, (1, 5)) > 1000
    assert st(64) == pytest.approx(st.c0 + st.c1 * 64)         # graph steps left the token-count curve alone


def test_the_guard_overrules_a_controller_that_is_wrong():
    """Measured tokens per second, drafter on against off, have the last word: where the controller's models are
    wrong (here it keeps every draft; on the H200 unpriced host work made adaptive speculation 0.2-0.8x of plain
    at batch 64), the guard finds speculation slower than plain decoding and switches the drafter off."""
    plain = plain_rate(cpu_heavy)
    rate, per_step, spec = simulate(cpu_heavy, 0.3, steps=600, wrong=True)
    assert spec.guard.num_vetoes >= 1 and spec.guard.vetoed(1)
    assert np.mean(per_step[-200:]) < 0.5
    assert rate >= 0.85 * plain
    unguarded = simulate(cpu_heavy, 0.3, steps=600, wrong=True, guard=False)[0]
    assert unguarded < 0.6 * plain


def test_guard_windows_vetoes_and_cooldowns():
    from leapdecode.spec.guard import ThroughputGuard
    g = ThroughputGuard(margin=0.08, window=4, refresh=100, cooldown=10, min_samples=4)
    modes = []
    for _ in range(4):                      # the drafter's modes first: nothing to compare yet
        modes.append(g.bare(8))
        g.record(8, "spec", 0.010, 8)
    assert modes == [False] * 4
    for _ in range(4):                      # then a window of bare steps at this batch size
        assert g.bare(8)
        g.record(8, "bare", 0.010, 10)      # 1.0 ms a token against speculation's 1.25
    assert not g.bare(8)
    g.record(8, "spec", 0.010, 8)
    assert g.num_vetoes == 1 and g.vetoed(8) and g.cooldown == 20
    assert all(g.bare(8) for _ in range(9))             # the cool-down: no drafter at all
    assert not g.bare(8) and not g.vetoed(8)
    g.record(8, "spec", 0.010, 8)
    assert g.num_vetoes == 1                            # one fresh sample: not yet
    assert not g.bare(8)
    g.record(8, "spec", 0.010, 8)
    assert g.num_vetoes == 2 and g.cooldown == 40       # still slower: again, for twice as long


def test_guard_vetoes_are_per_batch_size():
    """A veto earned where speculation loses (batch 64) leaves batch 1, where it wins, alone; each size has its
    own doubling cool-down. (With one global veto, a burst of load switched speculation off for everyone.)"""
    from leapdecode.spec.guard import ThroughputGuard
    g = ThroughputGuard(margin=0.08, window=4, refresh=1000, cooldown=40, min_samples=4)
    for n, spec_spt, bare_spt in ((64, 1.3, 1.0), (1, 0.5, 1.0)):   # seconds per token: slower at 64, faster at 1
        for _ in range(4):
            assert not g.bare(n)
            g.record(n, "spec", spec_spt, 1)
        for _ in range(4):
            assert g.bare(n)
            g.record(n, "bare", bare_spt, 1)
        assert not g.bare(n)
        g.record(n, "spec", spec_spt, 1)
    assert g.num_vetoes == 1 and g.vetoed(64) and g.off(64) and not g.vetoed(1) and not g.off(1)
    assert not g.bare(1) and g.bare(64)                      # batch 1 drafts on while batch 64 sits out


def test_small_batch_fast_path_decides_as_the_numpy_path():
    """Up to SMALL_BATCH requests take a plain-Python path (numpy's per-call overhead was most of a 0.4 ms GPU
    step): on random acceptance histories, scores, calibrated confidences, offers and step-time models, with and
    without CUDA-graph buckets and exploration, its choices and its recorded decision (gain included, to the bit)
    equal the numpy path's."""
    import copy
    from leapdecode.spec.controller import SMALL_BATCH
    rng = random.Random(5)
    chosen = 0
    for trial in range(500):
        st = StepTimeModel()
        machine = [cpu_like, gpu_like, cpu_heavy][trial % 3]
        for n in (1, 2, 4, 8, 16, 64):
            st.observe(n, machine(n))
        graphs = trial % 2 == 1
        R = rng.randint(1, SMALL_BATCH)
        ctl = Controller(8, st, graph_bucket=(lambda b, q: (8, 1) if q <= 1 else (8, 9) if q <= 9 else None)
                         if graphs else None)
        if graphs:
            st.graphs.set_prior((8, 1), 0.0004)
            st.graphs.set_prior((8, 9), 0.0005 + 0.0004 * rng.random())
        for _ in range(rng.randint(0, 40)):
            k = rng.randint(1, 8)
            ctl.observe(rng.randint(0, 2 * R), k, rng.choice([0, k, rng.randint(0, k)]))
            if rng.random() < 0.3:
                st.observe(rng.randint(1, 9), machine(rng.randint(1, 9)) * (1 + 0.2 * rng.random()))
        props = []
        for sid in rng.sample(range(3 * R), R):
            room = rng.randint(0, 10)
            conf = sorted((rng.random() for _ in range(rng.randint(1, room))), reverse=True) \
                if room and rng.random() < 0.4 else None
            props.append((sid, room, rng.random(), *([conf] if conf else [])))
        ctl.num_calls = rng.randint(0, 70)                   # some calls explore
        fast, slow = copy.deepcopy(ctl), copy.deepcopy(ctl)
        slow.small_fast_path = False
        args = (props, R + rng.choice([0, 0, 5, 40]), rng.choice([0.0, 1e-5, 3e-4]), R if graphs else None)
        got, want = fast.draft_lengths(*args), slow.draft_lengths(*args)
        assert got == want and fast.last_choice == slow.last_choice, (trial, props, got, want)
        assert fast._score == slow._score
        chosen += sum(got) > 0
    assert 50 < chosen < 450                                 # both outcomes were exercised


def test_step_time_predictions_in_plain_python_equal_the_numpy_path(monkeypatch):
    """A few token counts (a decision at small batches) are priced in plain Python, not numpy (~120 us a step
    inside the engine at batch 1 on the CPU): on random step histories, with and without the start-up probe's
    shape, per batch size, for prefill steps and as if old steps were forgotten, the prices equal the numpy path's
    to the bit, and no small prediction goes through numpy."""
    import leapdecode.spec.controller as C
    rng = random.Random(11)
    numpy_calls = []
    real_np = StepTimeModel._predict_np
    monkeypatch.setattr(StepTimeModel, "_predict_np", lambda self, ns, c: numpy_calls.append(len(ns)) or
                        real_np(self, ns, c))
    compared, limit = 0, C.SMALL_PREDICT
    for trial in range(300):
        st = StepTimeModel()
        machine = [cpu_like, gpu_like, cpu_heavy][trial % 3]
        if trial % 4:
            for n in (1, 2, 4, 8, 16, 32, 64):
                st.observe(n, machine(n) * rng.uniform(0.9, 1.1), num_seqs=1)
            st.mark_prior()
        for step in range(rng.randint(0, 50)):
            seqs = rng.choice([None, 1, 1, 2, 8, 16, 64])
            n = (seqs or 1) + rng.randint(0, 12) + (rng.randint(0, 200) if seqs is None else 0)
            st.observe(n, machine(n) * rng.lognormvariate(0.3, 0.2), num_seqs=seqs)
            if rng.random() < 0.3:
                seqs = rng.choice([None, 1, 2, 8, 16, 64])
                ns = (seqs or 1) + rng.randint(0, 80) + np.arange(rng.choice([1, 2, 5, 9, 33, C.SMALL_PREDICT]))
                since = rng.choice([None, step // 2])
                numpy_calls.clear()
                small, small_list = st.predict(ns, seqs, since), st.predict_list(ns.tolist(), seqs, since)
                assert not numpy_calls
                monkeypatch.setattr(C, "SMALL_PREDICT", 0)
                want = st.predict(ns, seqs, since)
                monkeypatch.setattr(C, "SMALL_PREDICT", limit)
                assert numpy_calls == [len(ns)]
                assert np.array_equal(small, want) and small_list == want.tolist(), (trial, step)
                assert st(int(ns[0]), seqs) == want[0] or since is not None
                compared += 1
    assert compared > 500


def test_the_goodput_test_decides_alike_in_plain_python_and_numpy(monkeypatch):
    """``_beats_plain`` judges many draft counts (a large batch's) in numpy and a few in plain Python: on random
    expected tokens and step costs both give the same goodputs and the same best passing count, to the bit."""
    import leapdecode.spec.controller as C
    rng = random.Random(3)
    limit, passing = C.SMALL_PREDICT, 0
    for _ in range(2000):
        m = rng.randint(1, 80)
        expected = [1.0]
        for _ in range(m):
            expected.append(expected[-1] + rng.random() * rng.choice([0.1, 1.0]))
        cost = [0.01]
        for _ in range(m):
            cost.append(cost[-1] * (1.0 + rng.random() * rng.choice([0.01, 0.2])))
        args = (expected, cost, expected[0] / cost[0], 1.0 + rng.random() * 0.1, rng.random() * 0.3)
        monkeypatch.setattr(C, "SMALL_PREDICT", 10 ** 6)
        small = C._beats_plain(*args)
        monkeypatch.setattr(C, "SMALL_PREDICT", -1)
        large = C._beats_plain(*args)
        monkeypatch.setattr(C, "SMALL_PREDICT", limit)
        assert small == large, (m, small[1], large[1])
        passing += small[1] > 0
    assert 20 < passing < 1980                               # both outcomes were exercised


def test_shadow_drafts_of_a_costly_drafter_cost_about_two_percent():
    """A model drafter (2 ms a request) that never pays, at batch 64 with requests coming and going (one new every
    other step), speculation off after the first step: shadow drafts are paid from a credit of ``QUIET_SHARE`` of
    each quiet step, longest-waiting requests first. Spaced per request only (the rule before), every new request
    was shadowed at once: 0.69x of plain decoding here (0.96x now)."""
    rate, _, spec = simulate(gpu_like, 0.0, batch=64, steps=600, draft_seconds=2e-3, turnover=2, guard=False)
    assert spec.num_shadow_proposals > 20                    # the requests are still watched
    assert rate >= 0.94 * plain_rate(gpu_like, 64)


def test_shadows_are_bought_by_what_drafting_could_gain():
    """A quiet step's share for shadow drafts is scaled by what drafting could gain there at best (tokens per
    second with every request's longest draft accepted, over plain decoding's, from the cost curve): where a
    verified token costs nearly what a decoded one does (compute-bound; batch 64 on the CPU, where perfect drafts
    would gain ~10%), a costly drafter is hardly shadowed and the run goes at plain decoding's speed (0.98x with
    the whole share); where a step is flat in its tokens (GPU-like), the requests are watched as before."""
    rate, _, spec = simulate(cpu_heavy, 0.0, batch=64, steps=400, draft_seconds=2e-3, turnover=2, guard=False)
    assert spec.num_shadow_proposals < 10 and rate >= 0.995 * plain_rate(cpu_heavy, 64)
    _, _, gpu = simulate(gpu_like, 0.0, batch=64, steps=400, draft_seconds=2e-3, turnover=2, guard=False)
    assert gpu.num_shadow_proposals > 20


def test_unspent_shadow_credit_is_kept_for_a_few_steps_only():
    """Credit a quiet stretch did not spend (nothing was due) is kept up to ``SHADOW_BANK`` quiet steps' worth: the
    first quiet step of a new batch spends at most that on shadows. (With 64 steps' worth, the credit banked over
    one run of 64 requests paid for ~2 ms of shadows in each of the next batch's first quiet steps on the CPU.)"""
    from leapdecode.spec.speculator import QUIET_SHARE, SHADOW_BANK
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=FakeDrafter(0.0))
    spec = fabricated_drafting(Speculator(cfg, 50_000, probed_model()), per_request=1e-3)
    step = 0.1
    reqs = [DraftRequest(i, Seq(i).token_ids, 16, 4, None, 0, []) for i in range(65)]
    spec._propose_shadows(reqs[64:], step)          # one shadow: its cost is measured
    for _ in range(200):
        spec._propose_shadows([], step)             # quiet steps with nothing due
    spec._propose_shadows(reqs[:64], step)
    shadowed = len(spec._shadow) - 1
    assert 1 <= shadowed <= SHADOW_BANK * QUIET_SHARE * step / 1e-3 + 1


def test_speculation_comes_back_after_a_load_spike_on_verification_steps():
    """A burst of load that makes the first 40 steps' verifications 6x slower (plain steps and the start-up probe
    unaffected) must not keep speculation off on text it decodes 2.3x faster. It did, twice over: the guard's
    evidence aged only with the drafter's own steps, so every veto's cool-down ended in another veto two steps
    later (guard.py, ``record``); and the step-time model priced every draft size at its spiked steps (93-129 ms
    where they cost 15-21 ms), and a size that is not chosen is not timed again (``Controller._retime``). Either
    fix alone leaves it off (0.89x of plain decoding)."""
    calls = [0]

    def machine(n):
        calls[0] += 1
        return cpu_like(n) * (6.0 if calls[0] <= 40 and n > 1 else 1.0)
    rate, per_step, _ = simulate(machine, 0.9, steps=400, probe_time=cpu_like)     # (the start-up probe is not hit)
    assert np.mean(per_step[-100:]) > 2.0 and rate > 1.5 * plain_rate(cpu_like)


def test_shadow_drafts_price_drafting_after_a_slow_draft():
    """A draft that takes 20 steps' time (a burst of load) turns speculation off; shadow drafts of every request
    are whole drafting steps and price drafting again. Priced only by real drafting steps, the charge stayed at
    that draft and speculation never came back. The guard is off here: it would veto the drafter on that step,
    and the speculator's pricing is what is tested."""
    rate, per_step, spec = simulate(cpu_like, 0.9, steps=300, slow_drafts={2: 0.2}, guard=False)
    assert spec.draft_seconds_ema < 1e-3
    assert np.mean(per_step[-100:]) > 2.0
    assert rate >= 1.5 * plain_rate(cpu_like)


def test_the_drafters_first_call_is_a_warm_up():
    """The drafter's first call (one-off costs: layer_skip's took 250-280 ms on the CPU, its later drafts 45) is
    neither drafting time to charge nor a step for the guard: speculation goes on from the start."""
    rate, per_step, spec = simulate(cpu_like, 0.9, steps=100, slow_drafts={1: 0.25})
    assert np.mean(per_step[:50]) > 2.0 and spec.guard.num_vetoes == 0
    assert spec.drafter_seconds >= 0.25                  # it was spent all the same
    assert rate >= 1.5 * plain_rate(cpu_like)


def test_one_slow_step_pools_with_the_better_known_sizes_instead_of_lifting_them():
    """The curve is kept non-decreasing by pooling a bucket that breaks the order with its neighbours, weighted by
    the steps behind each: one slow 2-token step among well-timed 1- and 5-token steps no longer prices every
    draft of 2-5 tokens at its own cost (a draft that is not chosen is never timed again)."""
    st = probed_model(lambda n: 0.020 + 0.0002 * n)
    st.mark_prior()
    for _ in range(5):
        st.observe(1, 0.020, num_seqs=1)
        st.observe(5, 0.021, num_seqs=1)
    st.observe(2, 0.030, num_seqs=1)                     # one slow step (a collection, a busy neighbour)
    t = st.predict(np.arange(1, 6), num_seqs=1)
    assert t[0] == pytest.approx(0.020)
    assert t[-1] == pytest.approx((0.030 + 5 * 0.021) / 6)  # pooled, not max(0.030, 0.021)
    assert np.all(np.diff(t) >= 0) and t[1] < 0.0235


def test_thinly_timed_draft_sizes_are_tried_at_small_batches_only():
    """Below STALE_BATCH, a draft size predicted close to plain decoding (within explore_tolerance, not past it)
    whose price rests on fewer than EVIDENCE steps is tried, as an exploration, until it has that many: one slow
    step no longer keeps a size from being timed again. From STALE_BATCH on it is not tried."""
    from leapdecode.spec.controller import STALE_BATCH
    for batch in (1, STALE_BATCH):
        st = probed_model(lambda n: 0.020 + 0.0002 * n)
        ctl = Controller(4, st)
        ctl.explore_every = 0
        for _ in range(5):
            st.observe(batch, 0.020, num_seqs=batch)
        st.observe(2 * batch, 0.0232, num_seqs=batch)         # one slow step: 0.93x of plain at its price
        props = [(i, 1, 0.5, [0.08]) for i in range(batch)]
        picks = []
        for _ in range(5):
            keep = ctl.draft_lengths(props, batch, 0.0, batch)
            if any(keep):
                picks.append(ctl.last_choice["explored"])
                st.observe(batch + sum(keep), 0.0202, num_seqs=batch)     # what such a step really costs
        if batch < STALE_BATCH:
            assert picks[:Controller.EVIDENCE - 1] == [True] * (Controller.EVIDENCE - 1)
            assert picks[Controller.EVIDENCE - 1:] and not any(picks[Controller.EVIDENCE - 1:])   # then it pays
        else:
            assert picks == []


def test_a_draft_in_hand_keeps_what_pays_without_its_time_and_drafting_stops():
    """Drafts already made: where drafting does not pay with their time, the tokens that pay without it are still
    verified (that time is spent), and ``pays`` says False, so the speculator drafts no more until it would."""
    st = probed_model(lambda n: 0.020 + 0.0002 * n)
    ctl = Controller(4, st)
    ctl.explore_every = 0
    for _ in range(5):
        st.observe(1, 0.020, num_seqs=1)
        st.observe(3, 0.0205, num_seqs=1)
    props = [(0, 2, 0.5, [0.15, 0.04])]
    assert ctl.draft_lengths(props, 1, 0.004, 1) == [0]                 # charged 4 ms: not worth drafting
    keep = ctl.draft_lengths(props, 1, 0.004, 1, sunk=True)
    assert keep[0] > 0 and ctl.last_choice["pays"] is False              # in hand: verify the likely token
    ctl.draft_lengths([(0, 2, 0.5, [0.9, 0.8])], 1, 0.004, 1, sunk=True)
    assert ctl.last_choice["pays"] is True


def test_drafting_time_excludes_the_drafters_backlog(monkeypatch):
    """A drafter's catching up on tokens committed before the previous step (``last_backlog_seconds``: EAGLE over
    a new prompt) is not charged as drafting time per step; the shadows' budget still spends it. (A fake clock:
    the drafter takes 30 ms of which 25 are backlog.)"""
    import types
    import leapdecode.spec.speculator as speculator_mod
    clock = [100.0]
    monkeypatch.setattr(speculator_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Slow(FakeDrafter):
        def propose(self, requests):
            clock[0] += 0.030
            self.last_backlog_seconds = 0.025
            return super().propose(requests)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, drafter=Slow(0.5)), 50_000,
                      probed_model())
    from leapdecode.spec.drafter import DraftRequest
    _, dt, _ = spec._draft([DraftRequest(0, [1, 2, 3], 3, 4)])
    assert dt == pytest.approx(0.005) and spec._backlog_seconds == pytest.approx(0.025)


def test_the_guard_judges_the_drafters_steps_together():
    """Quiet steps (a draft declined, a shadow, a prompt's first draft) pay for what speculating steps verify: the
    drafter's steps are judged together against bare ones. Judged apart, quiet steps 18% dearer than bare vetoed a
    drafter whose steps together beat plain decoding."""
    from leapdecode.spec.guard import ThroughputGuard
    g = ThroughputGuard(margin=0.08, window=4, refresh=1000, cooldown=40, min_samples=4)
    for _ in range(4):
        assert not g.bare(1)
        g.record(1, "spec", 0.031, 2)                    # 15.5 ms a token
    for _ in range(4):
        assert g.bare(1)
        g.record(1, "bare", 0.0205, 1)
    for _ in range(12):
        assert not g.bare(1)
        g.record(1, "quiet", 0.0245, 1)
        g.record(1, "spec", 0.031, 2)
    assert g.num_vetoes == 0 and not g.vetoed(1)
    quiet = 0
    while not g.num_vetoes and quiet < 100:             # the drafter stops paying: quiet steps only, dearer
        g.bare(1)
        g.record(1, "quiet", 0.0245, 1)
        quiet += 1
    assert g.num_vetoes == 1 and quiet > 10


def test_a_small_batch_veto_ends_with_the_request_it_was_earned_on():
    """Below STALE_BATCH the drafter's record is about the requests' text: when a request ends, vetoes there are
    lifted and the drafter's rates forgotten (the bare rate stays); at batch 64 a veto keeps its cool-down."""
    from leapdecode.spec.guard import ThroughputGuard
    g = ThroughputGuard(margin=0.08, window=4, refresh=1000, cooldown=40, min_samples=4)
    for n in (1, 64):
        for _ in range(4):
            assert not g.bare(n)
            g.record(n, "spec", 1.3, 1)
        for _ in range(4):
            assert g.bare(n)
            g.record(n, "bare", 1.0, 1)
        assert not g.bare(n)
        g.record(n, "spec", 1.3, 1)
    assert g.num_vetoes == 2 and g.vetoed(1) and g.vetoed(64)
    g.request_ended()
    assert not g.vetoed(1) and not g.off(1) and g.vetoed(64)
    assert g._batches[1].rates["spec"].count == 0 and g._batches[1].rates["bare"].count == 4
    for _ in range(3):                                      # a new request: fresh evidence before any veto
        assert not g.bare(1)
        g.record(1, "spec", 1.3, 1)
    assert not g.vetoed(1)
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, drafter=FakeDrafter(0.5)), 50_000,
                      probed_model())
    spec.guard._batch(1).veto_until = spec.guard.steps + 100
    assert spec.guard.vetoed(1)
    spec.finish(Seq(0))                                     # the speculator tells the guard
    assert not spec.guard.vetoed(1)


class AlternatingDrafter(FakeDrafter):
    """Every other draft is sure and right (its 4 tokens accepted), the others unsure and wrong from the first
    token, and each says so in its confidences: a draft's worth that varies from position to position."""

    def __init__(self):
        super().__init__(1.0)
        self.n = 0

    def propose(self, requests):
        out = []
        for r in requests:
            self.n += 1
            good = self.n % 2 == 1
            toks = [truth(r.seq_id, len(r.token_ids) + j) + (0 if good else 1) for j in range(r.max_draft)]
            conf = [0.95 ** (j + 1) for j in range(len(toks))] if good else [0.1 * 0.1 ** j for j in range(len(toks))]
            out.append(Draft(toks, None, score=conf[0], confidence=conf))
        return out


def test_drafting_goes_on_while_it_pays_on_average():
    """One modest draft does not switch speculation off: drafting goes on while what its steps deliver, drafting
    time included, is above plain decoding on average (switched off by each modest draft, speculation came back
    only once a quiet re-check saw a confident shadow, and half the sure drafts were never made)."""
    drafter = AlternatingDrafter()
    spec = fabricated_drafting(Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                            drafter=drafter), 50_000, probed_model()), 0.002)
    spec.guard = None
    seq = Seq(0)
    verified = 0
    for _ in range(200):
        before = spec.drafter_seconds
        drafts = spec.propose([seq], [4], 0)
        d = drafts.get(0)
        emitted = commit(spec, [seq], drafts)
        verified += bool(d)
        spec.observe_step(1 + (len(d) if d else 0), spec.drafter_seconds - before + cpu_like(1 + (len(d) if d else 0)),
                          None, emitted)
    assert drafter.n >= 190 and verified >= 90        # a draft every step; the sure ones (half) verified


def test_a_step_of_many_drafts_weighs_as_many_in_the_running_value():
    """The running value that keeps drafting on weighs a step that drafted for R requests as R drafts
    (1 - (1 - VALUE_RATE) ** R): its value is an average over them already. After a good step, one step whose
    drafts are worth nothing switches drafting off at batch 16 (it went on for ~5 such steps, each spending ~5% of
    its time drafting for 16 requests), while at batch 1 one modest draft does not."""
    for batch, on_after in ((1, True), (16, False)):
        spec = fabricated_drafting(Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                drafter=FakeDrafter(0.9)), 50_000, probed_model()))
        spec.guard = None
        values = iter([1.5, 0.95])      # what the controller predicts for the drafts in hand, step by step

        def lengths(proposals, *a, **k):
            spec.controller.last_choice = {"value": next(values), "explored": False}
            return [0] * len(proposals)
        spec.controller.draft_lengths = lengths
        seqs = [Seq(i) for i in range(batch)]
        for _ in range(2):
            commit(spec, seqs, spec.propose(seqs, [4] * batch, 0))
            assert spec.drafter.calls > 0
        assert spec.speculating == on_after, batch


def test_a_stale_bare_rate_is_measured_again_before_it_vetoes():
    """The machine slowed down since the last bare window (drafter and plain steps alike): compared with that old
    bare rate, the drafter's steps look 15% slower. The guard measures bare again first (a window now), and
    vetoes only what is still slower than today's plain steps."""
    from leapdecode.spec.guard import ThroughputGuard
    for spec_seconds, vetoed in ((0.0100, False), (0.0140, True)):    # at par with today's plain steps; slower
        g = ThroughputGuard(margin=0.08, window=4, refresh=10_000, cooldown=40, min_samples=4, stale=64)
        for _ in range(4):
            assert not g.bare(1)
            g.record(1, "spec", 0.0087, 1)
        for _ in range(4):
            assert g.bare(1)
            g.record(1, "bare", 0.0087, 1)               # the machine then: 8.7 ms a step
        for _ in range(70):
            assert not g.bare(1)
            g.record(1, "spec", 0.0087, 1)               # the drafter at par
        for _ in range(40):                              # the machine slows to 10 ms a plain step
            if g.bare(1):
                g.record(1, "bare", 0.0100, 1)
            else:
                g.record(1, "spec", spec_seconds, 1)
        assert (g.num_vetoes >= 1) == vetoed


def test_drafts_in_a_step_that_prompts_fill_are_priced_by_what_they_push_back():
    """A step with prefill chunks: an accepted token is worth its row in a decode-only step of the batch (T(R)/R).
    Priced by the step's tokens
    per second instead, drafts a third of whose tokens are accepted looked like a 1.3x gain beside a 2,000-token
    chunk (at batch 64 on the CPU every prefill step verified drafts and the run lost ~4%). On a CPU-like machine
    they do not pay; where prompt tokens are cheap beside a decode step's fixed cost (GPU-like) they do, and drafts
    that are nearly always accepted pay on both."""
    def machine(decode, chunk):
        st = StepTimeModel()
        for _ in range(3):
            for n in (1, 8, 16, 32):
                st.observe(n, decode(n), num_seqs=n)       # decode-only steps
            for n in (500, 1000, 2016, 2048, 2200):
                st.observe(n, chunk(n))                   # steps with prompt chunks
        return Controller(8, st)

    cpu = machine(lambda n: 0.017 + 0.002 * n, lambda n: 0.017 + 0.001 * n)
    gpu = machine(lambda n: 0.005 + 0.00001 * n, lambda n: 0.005 + 0.00002 * n)

    def kept(ctl, q, prompt_tokens=2000):
        proposals = [(i, 1, 0.5, [q]) for i in range(16)]
        return sum(ctl.draft_lengths(proposals, 16 + prompt_tokens, num_seqs=None))

    # decode steps that a CUDA graph replays are timed per bucket, not on the token-count curves: the price of a
    # token there is its bucket's time (2 ms for 16 rows), not the prompt steps' curve at 16 tokens (5.2 ms)
    graphed = machine(lambda n: 0.005 + 0.00001 * n, lambda n: 0.005 + 0.00002 * n)
    graphed.graph_bucket = lambda num_seqs, q: (num_seqs, q)
    graphed.step_time._curves = {k: c for k, c in graphed.step_time._curves.items() if k == "mixed"}
    for _ in range(3):
        graphed.step_time.observe(16, 0.002, graph=(16, 1))
    assert kept(gpu, 0.12) == 16 and kept(graphed, 0.12) == 0
    assert kept(cpu, 0.3) == 0 and kept(cpu, 0.3, prompt_tokens=500) == 0
    assert kept(cpu, 0.95) == 16
    assert kept(gpu, 0.3) == 16
    # 16 requests decoding while the prompts of 16 more go in will decode at 32, where a row costs less (GPU-like:
    # half): drafts worth it at 16 may not be at 32
    assert kept(gpu, 0.12) == 16
    assert sum(gpu.draft_lengths([(i, 1, 0.5, [0.12]) for i in range(16)], 16 + 2000, num_seqs=None, batch=32)) == 0


def test_the_engine_counts_waiting_prompts_in_a_steps_prefill_work():
    """``Engine._prefill_work``: the scheduler serves decodes and drafts first, then running prompts, then waiting
    ones, so the step's prompt work includes waiting prompts that can be admitted, up to the budget."""
    from types import SimpleNamespace as NS
    from leapdecode.engine.engine import Engine

    def seq(n, done=0):
        return NS(num_tokens=n, num_computed_tokens=done, num_placeholders=0)

    def work(running, prefilling, waiting, budget=2048, max_seqs=64, decoding=10):
        eng = NS(scheduler=NS(max_num_seqs=max_seqs, running=running, waiting=waiting, max_num_batched_tokens=budget))
        return Engine._prefill_work(eng, decoding, prefilling)

    decodes = [seq(50, 49) for _ in range(10)]
    assert work(decodes, [], []) == (0, 10)
    assert work(decodes, [], [seq(300), seq(300)]) == (600, 12)
    assert work(decodes, [], [seq(3000)]) == (2038, 11)
    assert work(decodes, [], [seq(300)] * 3, max_seqs=12) == (600, 12)       # only two more can be admitted
    running_prompt = seq(1000, 400)
    assert work(decodes + [running_prompt], [running_prompt], [seq(2000)]) == (2038, 12)


def test_a_step_is_priced_as_what_it_ran_not_as_it_was_expected():
    """Before scheduling, a step with waiting prompts is expected to hold prompt chunks; if the pool admits none
    it runs decodes only, and its time belongs on the curve of that batch size (``observe_step(decodes=...)``),
    not on the prompt steps' curve; the guard, which decided for the step it expected, does not judge it."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=FakeDrafter(0.9))
    spec = Speculator(cfg, 50_000, StepTimeModel())
    st = spec.controller.step_time
    seqs = [Seq(i) for i in range(4)]
    spec.propose(seqs, [4] * 4, 300)             # expected: prompt chunks beside the decodes
    spec.observe_step(4, 0.020, decodes=4)       # ran: four decodes
    assert st._bucket(4, 4) is not None and st._bucket(4, None) is None
    spec.propose(seqs, [4] * 4, 0)               # expected: decodes only
    spec.observe_step(304, 0.200, decodes=None)  # ran: with a prompt chunk
    assert st._bucket(304, None) is not None and st._bucket(304, 4) is None
    spec.propose(seqs, [4] * 4, 0)
    spec.observe_step(4, 0.021, decodes=4)       # as expected
    assert len(st._bucket(4, 4).obs) == 2


def test_the_engine_tells_decode_only_plans_from_plans_with_prompt_chunks():
    """``engine._decode_seqs``: a plan whose sequences each compute one known token (with or without a draft) is
    decode-only; a prompt chunk makes it a step with prefill chunks (None)."""
    from leapdecode.engine.engine import _decode_seqs as _decodes
    from leapdecode.engine.step import ScheduledSeq, lay_out
    from leapdecode.spec.tree import DraftTree
    decode = ScheduledSeq(0, 40, (7,), (0, 1, 2), samples=True)
    verify = ScheduledSeq(1, 40, (7, 8, 9), (3, 4, 5), DraftTree.of((8, 9)), samples=True)
    chunk = ScheduledSeq(2, 0, tuple(range(30)), (6, 7), samples=False)
    assert _decodes(lay_out(0, 16, [decode, verify])) == 2
    assert _decodes(lay_out(0, 16, [decode, verify, chunk])) is None


def test_a_drafter_the_guard_keeps_off_learns_no_top_k():
    """While the guard has the drafter off, the step computes no top-k for it (``learns_topk``; ~1 ms a step at
    batch 64 on the CPU, a quiet speculator's cost with no draft to use it); a drafter that drafts learns."""
    _, _, spec = simulate(cpu_heavy, 0.3, steps=600, wrong=True)
    spec.drafter.wants_topk = True
    assert spec.guard.vetoed(1)
    assert spec.drafter_off(1, 0) and not spec.learns_topk()
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=FakeDrafter(0.9))
    fresh = Speculator(cfg, 50_000, StepTimeModel())
    fresh.drafter.wants_topk = True
    assert not fresh.drafter_off(1, 0) and fresh.learns_topk()


def test_claims_that_come_true_more_often_than_claimed_are_scaled_up():
    """A draft model's confidence (the running product of its own top probabilities) can under-claim: here each
    token claims 0.5 (cumulative 0.5, 0.25, ...) and nearly every one is accepted. Claims are scaled by accepted
    over claimed tokens in both directions (up to REALIZED_MAX, each scaled claim at most 1), so the controller
    keeps the drafts (~2x plain decoding here); with claims taken as at most what they say, it drafted nothing."""
    from leapdecode.spec.controller import REALIZED_MAX
    rate, per_step, spec = simulate(cpu_like, 0.97, batch=1, steps=200, claim=0.5)
    assert 1.5 < spec.controller.realized <= REALIZED_MAX
    assert np.mean(per_step[50:]) > 2.5
    assert rate > 1.5 * plain_rate(cpu_like)
    ctl = spec.controller                      # a scaled claim is a probability: at most 1 (numpy and small paths)
    rho = ctl._rho(ctl._acc[0])
    want = [min(1.0, c * (g * rho)) for c, g in zip([0.5, 0.25], ctl.rank_rates())]
    assert want[0] == 1.0 and 0.25 < want[1] <= 1.0
    assert ctl._values([(0, 2, 0.5, [0.5, 0.25])], 2).tolist()[0] == want
    assert ctl._row_values((0, 2, 0.5, [0.5, 0.25]), ctl._depth_rates(2)) == want


def test_a_draft_in_hand_is_judged_by_what_it_cost():
    """A draft already made is judged (``last_choice["value"]``, the running average that keeps drafting on) by
    its own drafting time, not the average: a draft model that stopped after one confident token cost a quarter of
    a four-token draft, and charged the average it looked like a loss (layer_skip was switched off so)."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                            drafter=FakeDrafter(1.0, claim=0.9))
    spec = fabricated_drafting(Speculator(cfg, 50_000, probed_model()), per_request=0.008, slow={4: 0.0005})
    spec.guard = None
    seq = Seq(0)
    values = []
    for _ in range(5):
        drafts = spec.propose([seq], [4], 0)
        n = len(drafts[seq.seq_id])
        seq.token_ids += [truth(seq.seq_id, len(seq.token_ids) + j) for j in range(n + 1)]
        spec.observe(seq, n, n, None)
        spec.observe_step(1 + n, cpu_like(1 + n), None, n + 1)
        values.append(spec.controller.last_choice["value"])
    assert spec.draft_seconds_ema > 0.006                  # the average still remembers the 8 ms drafts
    assert values[3] > 1.9 > 1.5 > max(values[:3] + values[4:])   # the 0.5 ms draft, judged by its 0.5 ms


def test_a_quiet_step_with_prompt_chunks_is_checked_with_the_decoding_batch(monkeypatch):
    """While speculation is off, a step that holds prefill chunks asks the controller with the batch that will
    decode (the engine's count), not with the tuple of request ids the quiet bookkeeping keeps: that tuple reached
    the mixed-step rule and raised (the engine logged 'drafter failed' and ran such steps without drafts)."""
    seen = []
    real = Controller.worth_drafting

    def spy(self, offers, other_tokens, draft_seconds=0.0, num_seqs=None, batch=None):
        seen.append(batch)
        return real(self, offers, other_tokens, draft_seconds, num_seqs, batch)
    monkeypatch.setattr(Controller, "worth_drafting", spy)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, drafter=FakeDrafter(0.0))
    spec = Speculator(cfg, 50_000, probed_model(cpu_like))
    spec._speculating = False
    seqs = [Seq(i) for i in range(4)]
    spec.propose(seqs, [4] * 4, 500, 32)          # 500 prompt tokens in the step; 32 sequences will decode
    assert seen == [32]


def test_a_quiet_model_drafter_drafts_for_real_after_a_doubling_wait():
    """A drafter that runs a model is rarely shadowed, and the quiet re-check values a request by its last draft:
    while quiet it drafts for real after RETRY_QUIET quiet steps, then after twice as many each time a retry does
    not switch drafting back on (here never: every draft fails and claims so); not from STALE_BATCH requests on."""
    from leapdecode.spec.speculator import RETRY_QUIET

    def run(batch, steps, retries=True):
        cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                                drafter=FakeDrafter(0.0, claim=0.02))
        spec = fabricated_drafting(Speculator(cfg, 50_000, probed_model(cpu_like)), DRAFT_SECONDS, None)
        spec.guard = None
        spec._retries = retries         # what a model drafter gets (registry.MODEL_METHODS); this fake one is not
        spec._speculating = False
        seqs, real = [Seq(i) for i in range(batch)], []
        for step in range(steps):
            before = spec.num_proposals
            drafts = spec.propose(seqs, [4] * batch, 0)
            n = batch + sum(len(d) for d in drafts.values())
            spec.observe_step(n, cpu_like(n), None, commit(spec, seqs, drafts))
            if spec.num_proposals > before:
                real.append(step)
        return real

    real, without = run(1, 130), run(1, 130, retries=False)
    n = len(without)                        # the controller times each draft size a few times, then stays quiet
    assert without == list(range(n)) and n <= 8
    assert real[:n] == without and list(np.diff(real[n - 1:n + 4])) == [RETRY_QUIET, 2 * RETRY_QUIET,
                                                                       4 * RETRY_QUIET, 8 * RETRY_QUIET], real
    assert run(8, 60) == run(8, 60, retries=False)


def one_request_after_another(spec, steps, first=0, every=40):
    """Batch-1 steps on a CPU-like machine, a new request every ``every`` steps (the previous one finished), from
    request ``first`` on; returns the steps (numbered from the first request's start) that drafted for real."""
    real = []
    for step in range(first * every, first * every + steps):
        seq = Seq(step // every)
        if step % every == 0 and step:
            spec.finish(Seq(step // every - 1))
        before = spec.num_proposals
        drafts = spec.propose([seq], [4], 0)
        n = 1 + sum(len(d) for d in drafts.values())
        spec.observe_step(n, cpu_like(n), None, commit(spec, [seq], drafts))
        if spec.num_proposals > before:
            real.append(step)
    return real


def test_a_quiet_model_drafters_retry_wait_carries_over_to_new_requests():
    """Where a model drafter's drafts never pay, its retries keep doubling their wait across new requests (five
    requests of 40 steps one after another, every draft failing): a few retries in the whole run, not one or two
    per request, each a draft that costs steps (a layer_skip draft of 4 tokens ~2 plain steps on a CPU target that
    reads 4-bit codes); and its shadow drafts' share of the time shrinks as the retries' wait grows."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                            drafter=FakeDrafter(0.0, claim=0.02))
    spec = fabricated_drafting(Speculator(cfg, 50_000, probed_model(cpu_like)), 0.004, None)  # ~0.4 step
    spec.guard = None
    spec._retries = True
    real = one_request_after_another(spec, 40)
    shadows = spec.num_shadow_proposals
    real += one_request_after_another(spec, 160, first=1)
    later = [s for s in real if s >= 40]                  # after the first request (the controller's timings)
    assert len(later) <= 3, real
    assert spec.num_shadow_proposals - shadows <= 3, spec.num_shadow_proposals - shadows   # 8 at a fixed share


def test_speculation_comes_back_after_a_load_spike_on_graph_replays():
    """The same burst of load on CUDA-graph steps: replays of the verification bucket in the first 40 steps cost 6x. Its
    bucket is timed apart from the token-count curve (:class:`GraphTimes`), and its spiked times are forgotten and
    it is replayed again once they are old (``Controller._retime``), as an eager size is."""
    calls = [0]
    bucket_of, seconds_of, replay = H200_GRAPHS

    def bucket_seconds(b):
        calls[0] += 1
        return seconds_of(b) * (6.0 if b[1] > 1 and calls[0] <= 40 else 1.0)
    rate, per_step, spec = simulate(h200_eager, 0.95, k=4, steps=600, graphs=(bucket_of, bucket_seconds, replay))
    assert np.mean(per_step[-100:]) > 3.5
    assert spec.controller.step_time.graphs((1, 5)) == pytest.approx(0.00075, rel=0.05)


def test_a_request_whose_claims_fail_backs_off_though_others_came_true():
    """Calibrated claims are scaled by the request's own record first (Controller._rho): after a request whose
    drafts all came true (the global ratio of accepted to claimed tokens ~1.2), a second one whose drafts claim
    ~2 tokens a step and get none stops drafting within a few steps where verifying 4 draft tokens costs 1.8
    plain steps (a CPU step reading 4-bit weights). Scaled by the global ratio alone it kept drafting 4 tokens a
    step for more than ten steps, each a loss."""
    st = StepTimeModel()
    for _ in range(5):
        for n in range(1, 6):
            st.observe(n, 0.010 + 0.002 * (n - 1), num_seqs=1)
    ctl = Controller(4, st, explore_every=0)
    for _ in range(40):                                   # a request that copies: every claimed token accepted
        keep = ctl.draft_lengths([(1, 4, 0.5, [0.9, 0.85, 0.8, 0.75])], 1, num_seqs=1)
        ctl.observe(1, keep[0], keep[0])
    assert keep == [4] and ctl.realized > 1.1
    ctl.forget(1)
    kept = []
    for _ in range(14):                                   # its drafts claim ~2 tokens a step; none is accepted
        keep = ctl.draft_lengths([(2, 4, 0.5, [0.7, 0.55, 0.45, 0.35])], 1, num_seqs=1)
        ctl.observe(2, keep[0], 0)
        kept.append(keep[0])
    assert kept[0] == 4 and sum(kept[4:]) == 0, kept


def test_the_first_token_is_valued_by_the_drafters_score_not_one_rate_per_request():
    """A drafter's score says how much evidence is behind a draft (an n-gram drafter's match length: on the real
    model's outputs a 1-token match's first token was accepted ~10% of the time, a 4-token one's ~85%). One
    request whose drafts alternate between strong and weak matches: the controller learns each score's rate and
    drafts the strong ones only; valued by one rate for the request, both were worth the same."""
    rng = random.Random(0)
    ctl = Controller(4, timed_at_batch_1(cpu_like))
    for _ in range(100):
        for score, p in ((0.85, 0.9), (0.15, 0.05)):
            ok = rng.random() < p
            ctl.observe(1, 4, 4 if ok else 0, score=score)
    assert abs(ctl.first_rate(0.85) - 0.9) < 0.1 and ctl.first_rate(0.15) < 0.1
    assert ctl.draft_lengths([(1, 4, 0.85)], 1, num_seqs=1) == [4]
    assert ctl.draft_lengths([(1, 4, 0.15)], 1, num_seqs=1) == [0]
    # a verified draft is learnt from under the score it was kept with, whatever the drafter proposed since
    ctl.observe(1, 4, 4)
    n_strong = ctl._g_first_n[8]
    ctl.draft_lengths([(1, 4, 0.85)], 1, num_seqs=1)
    ctl.note(1, 0.15)
    ctl.observe(1, 4, 0)
    assert ctl._g_first_n[8] > n_strong


def test_calibrated_claims_are_scaled_rank_by_rank():
    """A calibrated drafter whose first claims come true and whose deeper ones do not (a fresh drafter's flat
    claims; auto on the default model's outputs: first-ranked claims met 0.7-1.2 times, fourth-ranked 0.0-0.4
    times on summaries, grounded QA and math): each rank's claims are scaled by what that rank got, so the
    controller keeps the first tokens of such drafts and not their tail. One scale over all ranks valued every
    token alike (~0.35 here) and kept all four where verifying each costs 15% of a step."""
    rng = random.Random(0)
    ctl = Controller(4, timed_at_batch_1(cpu_like))
    claims = [0.9, 0.85, 0.8, 0.75]
    for i in range(300):                                  # first token right 90% of the time, each next one 30%
        a = 0
        while a < 4 and rng.random() < (0.9 if a == 0 else 0.3):
            a += 1
        ctl.observe(100 + i, 4, a, claimed=claims)
        ctl.forget(100 + i)
    g = ctl.rank_rates()
    assert abs(g[0] - 1.0) < 0.15 and g[1] < 0.45 and g[2] < 0.2 and g[3] <= 0.1
    assert ctl.draft_lengths([(1, 4, 0.5, claims)], 1, num_seqs=1) == [2]


def test_a_retry_that_switches_drafting_on_for_a_few_steps_only_still_waits_longer_next_time():
    """A model drafter whose drafts claim enough to look marginally worth it and never come true (EAGLE on the CPU
    after session 26's faster step: retries predicted at 1.07-1.13x, drafting on for one to four steps): its retry
    wait is back to RETRY_QUIET only once a spell of drafting has lasted RETRY_PAID steps, so over ten requests it
    drafts twice after the first one; reset by any spell, it drafted five times (~5% of the decoding time on the
    CPU, each EAGLE draft ~0.4 of a step)."""
    from leapdecode.spec.speculator import RETRY_QUIET
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True,
                            drafter=FakeDrafter(0.0, claim=0.5))
    spec = fabricated_drafting(Speculator(cfg, 50_000, probed_model(cpu_like)), 0.004, None)
    spec.guard = None
    spec._retries = True
    real = one_request_after_another(spec, 400)
    later = [s for s in real if s >= 40]
    assert len(later) <= 2 and spec._retry_after > RETRY_QUIET, (real, spec._retry_after)
