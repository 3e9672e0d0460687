"""Calibrated drafting (spec/calibration.py): the acceptance model against exact counts, the chooser against a
brute-force definition, auto's verification cost with calibration on and off, and the controller valuing drafts
by their confidence."""
from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from leapdecode.spec.calibration import AcceptanceModel, ChainCalibration, Offer, choose, evidence
from leapdecode.spec.controller import Controller, StepTimeModel
from leapdecode.spec.drafter import DraftRequest
from leapdecode.spec.registry import make_drafter
from leapdecode.spec.tree import DraftTree


def offer(paths: list[tuple[int, ...]], key: int, prior: float) -> Offer:
    """An offer of the trie of ``paths`` (every prefix is a node), node keys ``key + depth``."""
    o, index = Offer(), {}
    for path in paths:
        for d in range(1, len(path) + 1):
            if path[:d] not in index:
                index[path[:d]] = len(o.tokens)
                o.tokens.append(path[d - 1])
                o.parents.append(index[path[:d - 1]] if d > 1 else -1)
                o.depths.append(d)
                o.keys.append(key + d)
                o.priors.append(prior)
    return o


def test_learn_judges_exactly_the_nodes_whose_parent_path_was_committed():
    """A node is judged iff its depth is within the committed tokens and its parent path equals them; it counts as
    accepted iff its own token matches too (brute force over the trie's paths)."""
    paths = [(1, 2, 3, 4), (1, 2, 5), (1, 6), (7, 8), (1, 2, 3, 9)]
    o = offer(paths, evidence(3), 0.5)
    for committed in [(1, 2, 3), (1, 2), (7,), (1, 6, 6, 6, 6), (9, 9), (1, 2, 3, 4, 4)]:
        model = AcceptanceModel()
        model.learn([o], committed)
        expected: dict[int, list[float]] = {}
        for i, tok in enumerate(o.tokens):
            node = [tok]
            p = o.parents[i]
            while p >= 0:
                node.insert(0, o.tokens[p])
                p = o.parents[p]
            d = len(node)
            if d <= len(committed) and tuple(node[:-1]) == tuple(committed[:d - 1]):
                c = expected.setdefault(o.keys[i], [0.0, 0.0])
                c[0] += node[-1] == committed[d - 1]
                c[1] += 1
        assert model.snapshot() == {k: tuple(v) for k, v in expected.items()}, committed


def test_acceptance_model_converges_to_the_observed_rates_and_starts_from_the_prior():
    rng = random.Random(0)
    model = AcceptanceModel(strength=4.0)
    good, bad = evidence(1), evidence(2)
    assert model.estimate(good, 0.3) == 0.3              # never seen: the drafter's own prior
    for _ in range(2000):
        truth = rng.randrange(2)
        # "good" evidence names the right token 80% of the time, "bad" 20%
        g = truth if rng.random() < 0.8 else 1 - truth
        b = truth if rng.random() < 0.2 else 1 - truth
        model.learn([offer([(g,)], good, 0.5), offer([(b,)], bad, 0.5)], (truth,))
    assert abs(model.estimate(good + 1, 0.5) - 0.8) < 0.05
    assert abs(model.estimate(bad + 1, 0.5) - 0.2) < 0.05


def brute_force_path_probs(offers: list[Offer], model: AcceptanceModel) -> dict[tuple[int, ...], float]:
    """Every merged path's probability from the definition: per path, the best first-stage estimate among the
    sources offering it, the number of them, its rank among its siblings, then the second-stage estimate, times
    the parent's probability."""
    best: dict[tuple, float] = {}
    agree: dict[tuple, int] = {}
    order: list[tuple] = []
    for o in offers:
        for i in range(len(o.tokens)):
            path, j = [], i
            while j >= 0:
                path.insert(0, o.tokens[j])
                j = o.parents[j]
            path = tuple(path)
            if path not in best:
                order.append(path)
                best[path], agree[path] = 0.0, 0
            best[path] = max(best[path], model.estimate(o.keys[i], o.priors[i]))
            agree[path] += 1
    prob: dict[tuple, float] = {}
    for path in order:
        siblings = sorted((p for p in order if len(p) == len(path) and p[:-1] == path[:-1]),
                          key=lambda p: (-best[p], order.index(p)))
        rank = siblings.index(path)
        depth = len(path) if len(path) <= 3 else (4 if len(path) <= 6 else 7)
        key = evidence(999) + min(9, int(best[path] * 10)) * 10000 + min(agree[path], 3) * 1000 + \
            min(rank, 2) * 100 + depth
        prob[path] = model.estimate(key, best[path]) * (prob[path[:-1]] if len(path) > 1 else 1.0)
    return prob


@pytest.mark.parametrize("seed", range(6))
def test_choose_is_the_best_first_cut_of_the_merged_offers(seed):
    rng = random.Random(seed)
    model = AcceptanceModel()
    offers = []
    for kind in range(1, 4):
        paths = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        offers.append(offer(paths, evidence(kind), rng.choice([0.2, 0.5, 0.9])))
    for _ in range(30):                               # a history, so estimates differ from the priors
        model.learn(offers + [choose(offers, model, 16, 0.0)[1]], tuple(rng.randrange(4) for _ in range(4)))
    probs = brute_force_path_probs(offers, model)
    for max_nodes, min_prob in itertools.product([1, 3, 8, 64], [0.0, 0.05, 0.3]):
        draft, merged = choose(offers, model, max_nodes, min_prob)
        confidence = draft.confidence or []
        tree = DraftTree.of(draft.tokens, draft.parents)
        paths = [tuple(p) for p in tree.node_paths()]
        assert len(set(paths)) == len(paths)          # shared prefixes are one node
        # nodes in topological order, each prefix a tree, probabilities non-increasing and exact
        assert all(p < i for i, p in enumerate(tree.parents or range(-1, len(paths) - 1)))
        assert len(confidence) == len(paths)
        assert all(math.isclose(c, probs[p]) for c, p in zip(confidence, paths))
        assert confidence == sorted(confidence, reverse=True)
        eligible = sorted((p for p in probs if probs[p] >= min_prob), key=lambda p: -probs[p])
        assert len(paths) == min(max_nodes, len(eligible))
        if paths and len(eligible) > len(paths):      # the cut drops nothing better than what it keeps
            assert probs[eligible[len(paths)]] <= min(confidence) + 1e-12
        assert len(merged.tokens) == len(probs)


def copy_and_chatter(rng: random.Random) -> tuple[list[int], list[int]]:
    """A small vocabulary (short n-gram matches are everywhere and rarely right) with long copied spans: the
    workload where uncalibrated drafting verifies many tokens that fail."""
    passage = [rng.randrange(40) for _ in range(300)]
    prompt = [rng.randrange(40) for _ in range(50)] + passage
    output = []
    for start in range(0, 240, 60):
        output += [rng.randrange(40) for _ in range(30)] + passage[start:start + 30]
    return prompt, output


def replay(drafter, prompt: list[int], output: list[int], k: int) -> tuple[float, float]:
    """(tokens per step, verified tokens per output token) of a greedy replay."""
    ctx, t, steps, verified = list(prompt), 0, 0, 0
    while t < len(output):
        draft = drafter.propose([DraftRequest(0, ctx, len(prompt), k)])[0]
        emitted = min(draft.tree.accepted_length(output[t:]) + 1, len(output) - t)
        ctx += output[t:t + emitted]
        t += emitted
        steps += 1
        verified += 1 + len(draft.tokens)
        drafter.observe(0, ctx, emitted - 1, None)
    drafter.finish(0, ctx, len(prompt))
    return len(output) / steps, verified / len(output)


def test_calibrated_auto_verifies_far_fewer_tokens_for_nearly_the_same_tokens_per_step():
    """Issue 19's 'propose what is likely to be accepted, and no more': with calibration the auto drafter drafts
    where its evidence has been right; without it (fill) it tops every draft up with guesses."""
    rng = random.Random(3)
    cases = [copy_and_chatter(rng) for _ in range(3)]
    results = {}
    for calibrate in (True, False):
        auto = make_drafter("auto", vocab_size=64, calibrate=calibrate)
        per = [replay(auto, p, o, k=8) for p, o in cases]
        results[calibrate] = (np.mean([x for x, _ in per]), np.mean([v for _, v in per]))
    (tps_on, ver_on), (tps_off, ver_off) = results[True], results[False]
    assert ver_on < 1.7 < ver_off, results
    assert tps_on > 0.9 * tps_off and tps_on > 1.5, results


def test_controller_values_drafts_by_their_confidence():
    """Two requests offer drafts of equal length and equal history; on a machine where every verified token costs,
    the controller gives the tokens to the draft whose confidence says they will be accepted."""
    step_time = StepTimeModel()
    for n in range(1, 40):
        step_time.observe(n, 0.010 + 0.002 * n)
    sure = [0.95, 0.9, 0.86, 0.8, 0.75, 0.7]
    unsure = [0.2, 0.05, 0.02, 0.01, 0.005, 0.001]
    for a, b in [(sure, unsure), (unsure, sure)]:
        ctl = Controller(max_draft=6, step_time=step_time)
        keep = ctl.draft_lengths([(1, 6, a[0], a), (2, 6, b[0], b)], other_tokens=2)
        confident = 0 if a is sure else 1
        assert keep[confident] >= 4 and keep[1 - confident] == 0, keep


def test_drafters_without_offers_join_with_generic_evidence():
    """A drafter that has no ``offers`` (prompt lookup) takes part through its draft, keyed by its name and depth:
    on a copy workload its evidence is learnt and the calibrated auto copies well."""
    rng = random.Random(5)
    passage = [rng.randrange(1000) for _ in range(200)]
    prompt, output = [rng.randrange(1000) for _ in range(20)] + passage, passage[:150]
    auto = make_drafter("auto", vocab_size=1000, methods=["ngram"])
    tps, ver = replay(auto, prompt, output, k=8)
    keys = auto.acceptance.snapshot()
    assert any(isinstance(k, tuple) and k[0] == "ngram" for k in keys), keys
    assert tps > 4.0 and ver < 1.5, (tps, ver)


def test_chain_calibration_values_a_model_drafter_by_what_its_tokens_achieved():
    """A model drafter's own probability of its tokens is not their acceptance: a quantized self-draft unsure at
    0.3 a token whose tokens are all accepted was valued at 0.3^j, so the controller switched it off. Calibrated,
    its chains' path probabilities rise toward 1 per token, and a bucket whose tokens fail (0.95 here) falls;
    each bucket's estimate is exactly its Beta posterior around the drafter's prior."""
    cal = ChainCalibration()
    truth = [random.Random(3).randrange(50) for _ in range(400)]
    n, first = 10, None
    for _ in range(30):
        draft = truth[n:n + 4]
        conf = cal.confidences(7, truth[:n], draft, [0.3] * 4, [False] * 4)
        first = first or conf
        cal.observe(7, truth[:n + 5])                 # all four accepted, and the bonus token
        n += 5
    assert first == pytest.approx([0.3 ** j for j in range(1, 5)])
    conf = cal.confidences(7, truth[:n], truth[n:n + 4], [0.3] * 4, [False] * 4)
    p = (120 + 4 * 0.3) / (120 + 4)
    assert conf == pytest.approx([p ** j for j in range(1, 5)]) and conf[3] > 0.85
    # a sure-looking bucket that fails: its first token is rejected every time
    for _ in range(20):
        wrong = (truth[n] + 1) % 50
        cal.confidences(8, truth[:n], [wrong, truth[n + 1]], [0.95, 0.3], [False, False])
        cal.observe(8, truth[:n + 1])
        n += 1
    sure = cal.confidences(8, truth[:n], [truth[n]], [0.95], [False])
    assert sure == pytest.approx([(0 + 4 * 0.95) / (20 + 4)])
    # sampled and greedy tokens are separate evidence
    assert cal.confidences(9, truth[:n], [truth[n]], [0.3], [True]) == pytest.approx([0.3])


def test_chain_calibration_judges_a_shadow_draft_as_its_tokens_come():
    """A draft that plain decoding overtakes one token at a time (a shadow draft) is judged at every depth the
    committed tokens reach: to its end, at its first mismatch, or when the next draft replaces it (what is known
    by then); a finished request is judged on its last tokens."""
    truth = list(range(100, 140))
    cal = ChainCalibration()
    cal.confidences(1, truth[:10], truth[10:14], [0.5] * 4, [False] * 4)
    for n in range(11, 15):
        cal.observe(1, truth[:n])
    assert sum(v[1] for v in cal.model.snapshot().values()) == 4      # all four depths, all accepted
    assert sum(v[0] for v in cal.model.snapshot().values()) == 4
    cal = ChainCalibration()
    cal.confidences(1, truth[:10], [truth[10], 0, truth[12]], [0.5] * 3, [False] * 3)
    for n in range(11, 16):
        cal.observe(1, truth[:n])
    assert [tuple(v) for v in cal.model.snapshot().values()] == [(1.0, 2.0)]   # depth 2 failed; 3 never judged
    cal = ChainCalibration()
    cal.confidences(1, truth[:10], truth[10:14], [0.5] * 4, [False] * 4)
    cal.observe(1, truth[:12])
    cal.confidences(1, truth[:12], truth[12:13], [0.5], [False])          # replaces it: depths 1-2 judged
    cal.finish(1, truth[:13])                                            # and this one at depth 1
    assert [tuple(v) for v in cal.model.snapshot().values()] == [(3.0, 3.0)]
