"""Mirostat (Basu et al., ICLR 2021) against a reference written here from the paper's equations: a loop over the
transformers model (full forward per token, float32) that truncates, renormalises, draws with the engine's keyed
uniform and its own inverse CDF, and updates mu in float64. Same seed, same tokens, same trajectory of mu."""
import math
import random

import numpy as np
import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.sampling.sampler import seeded_uniform

VOCAB = 384


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


# -- the reference, from the paper's equations --------------------------------------------------------------------

def keep_v2(p, mu):
    """Algorithm 2: tokens of surprise -log2 p <= mu, and always the most likely one."""
    keep = -np.log2(p) <= mu
    keep[np.argmax(p)] = True
    return keep


def keep_v1(p, mu, m=100):
    """Algorithm 1: Zipf exponent from the top m probabilities, then top-k with k from it and mu."""
    top = np.sort(p)[::-1][:m]
    i = np.arange(1, m, dtype=np.float64)
    t, b = np.log((i + 1) / i), np.log(top[:-1] / top[1:])
    s = (t * b).sum() / (t * t).sum()
    eps, n = s - 1, len(p)
    k = (eps * 2.0 ** mu / (1 - n ** -eps)) ** (1 / s)
    k = int(min(max(math.floor(k + 0.5), 1), n))
    keep = np.zeros(len(p), dtype=bool)
    keep[np.argsort(-p, kind="stable")[:k]] = True
    return keep


def reference(model, prompt, max_tokens, seed, tau, eta, version=2, temperature=1.0, index=0):
    """-> (tokens, mu after each token)."""
    ids, mu, out, mus = list(prompt), 2 * tau, [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy() / temperature
        p = np.exp(logits - logits.max())
        p /= p.sum()
        keep = (keep_v2 if version == 2 else keep_v1)(p, mu)
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        u = seeded_uniform(seed, index, len(ids))
        x = int(np.searchsorted(np.cumsum(q), u, side="right"))     # inverse CDF: the first token with cdf > u
        mu -= eta * (-math.log2(q[x]) - tau)
        ids.append(x)
        out.append(x)
        mus.append(mu)
    return out, mus


# -- the engine, with the mu it kept -------------------------------------------------------------------------------

def record_mu(llm) -> dict:
    """request_id -> the mu its sequence held after each committed token (read from the Sequence after
    ``Scheduler.update``, the only writer)."""
    sched, trail = llm.engine.scheduler, {}
    update = sched.update

    def recording(plan, result, seqs):
        out = update(plan, result, seqs)
        for c in plan.seqs:
            r, seq = result.seqs.get(c.seq_id), seqs.get(c.seq_id)
            if r is not None and r.tokens and seq is not None and seq.params.mirostat:
                trail.setdefault((seq.request_id, seq.index), []).append(seq.mirostat_mu)
        return out

    sched.update = recording
    return trail


def generate(llm, ps, params):
    outs = llm.generate(ps, params, use_tqdm=False)
    assert_pool_free(llm)
    return [[o.token_ids for o in r.outputs] for r in outs]


CASES = [(2, 11, 3.0, 0.1, 1.0), (2, 1234, 5.0, 0.2, 1.0), (2, -7, 2.0, 1.0, 0.7), (2, 2**63 - 1, 4.0, 0.1, 1.3),
         (1, 5, 3.0, 0.1, 1.0), (1, 99, 5.0, 0.5, 0.8)]


@pytest.mark.parametrize("version,seed,tau,eta,temperature", CASES)
def test_seeded_mirostat_equals_the_reference(llama_dir, hf_model, version, seed, tau, eta, temperature):
    p = prompts(1, seed=abs(seed) % 1000)[0]
    params = SamplingParams(mirostat=version, mirostat_tau=tau, mirostat_eta=eta, temperature=temperature,
                            seed=seed, max_tokens=24, ignore_eos=True)
    llm = make_llm(llama_dir)
    trail = record_mu(llm)
    got = generate(llm, [p], params)[0][0]
    want, mus = reference(hf_model, p, 24, seed, tau, eta, version, temperature)
    assert got == want
    (key, engine_mus), = trail.items()
    assert np.allclose(engine_mus, mus, rtol=0, atol=1e-4), (engine_mus, mus)
    assert max(abs(m - 2 * tau) for m in mus) > eta          # the threshold moved


def test_the_reference_fails_without_mirostat(llama_dir, hf_model):
    """The comparison has teeth: the same seed with mirostat=0 (plain sampling) gives other tokens."""
    for seed, tau in ((11, 3.0), (1234, 2.0)):
        p = prompts(1, seed=seed % 1000)[0]
        want, _ = reference(hf_model, p, 24, seed, tau, 0.1)
        llm = make_llm(llama_dir)
        plain = generate(llm, [p], SamplingParams(seed=seed, max_tokens=24, ignore_eos=True))[0][0]
        assert plain != want


@pytest.mark.parametrize("tau", [2.0, 4.0])
def test_mean_surprise_is_held_at_tau(llama_dir, tau):
    """The controller works: over 300 tokens the observed surprise (recovered from mu's updates,
    s_t = tau + (mu_(t-1) - mu_t) / eta) averages near tau, and the two targets give clearly different means."""
    eta, n = 0.2, 300
    llm = make_llm(llama_dir, max_model_len=512)
    trail = record_mu(llm)
    generate(llm, [prompts(1, seed=3)[0]], SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, seed=42,
                                                           max_tokens=n, ignore_eos=True))
    (mus,) = trail.values()
    mus = [2 * tau] + mus
    surprise = [tau + (a - b) / eta for a, b in zip(mus, mus[1:])]
    assert len(surprise) == n
    tail = surprise[50:]
    assert abs(np.mean(tail) - tau) < 0.25, np.mean(tail)
    assert np.std(tail) > 0.3          # surprises vary token to token; only their mean is held


def test_mirostat_is_batch_independent_and_leaves_other_rows_alone(llama_dir):
    """A seeded Mirostat request (n=2 too) gives the same tokens alone and in a changing batch (Mirostat v1 and
    v2 rows beside seeded and unseeded sampled rows and greedy rows, chunked prefill, preemption); the other
    seeded and greedy requests get exactly the tokens they get without any Mirostat row near them."""
    ps = prompts(8, seed=5)
    miro = [SamplingParams(mirostat=2, mirostat_tau=3.0, seed=31, max_tokens=20, ignore_eos=True, n=2),
            SamplingParams(mirostat=1, mirostat_tau=4.0, mirostat_eta=0.3, seed=8, max_tokens=18, ignore_eos=True),
            SamplingParams(mirostat=2, mirostat_tau=2.5, temperature=0.8, seed=9, max_tokens=16, ignore_eos=True,
                           repetition_penalty=1.3, logit_bias={5: 3.0})]
    others = [SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True)]      # unseeded
    params = [miro[0], others[0], miro[1], others[1], miro[2], others[2], miro[0], others[0]]
    fixed = [i for i, sp in enumerate(params) if sp.seed is not None or sp.greedy]
    alone = {i: generate(make_llm(llama_dir), [ps[i]], params[i])[0] for i in fixed}
    for seed in (0, 5):
        llm = make_llm(llama_dir, seed=seed, max_num_batched_tokens=32, num_kv_blocks=24, max_model_len=64,
                       block_size=4)
        mixed = generate(llm, ps, params)
        assert {i: mixed[i] for i in fixed} == alone
        assert llm.engine.scheduler.num_preemptions > 0
    assert len(set(map(tuple, alone[0]))) == 2                                  # n=2: two samples, two mus


def test_mirostat_takes_no_drafts_and_no_overlapped_step(llama_dir):
    """Drafting is skipped for a Mirostat request (its mu after a draft token would depend on acceptance) while
    the ordinary request beside it speculates; with async scheduling the engine runs synchronous steps while a
    Mirostat request is in the batch. Tokens are those of plain decoding either way."""
    ps = prompts(2, seed=8)
    miro = SamplingParams(mirostat=2, mirostat_tau=3.0, seed=4, max_tokens=20, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, seed=6, max_tokens=20, ignore_eos=True)
    truth = {tuple(ps[0]): generate(make_llm(llama_dir), [ps[0]], miro)[0],
             tuple(ps[1]): generate(make_llm(llama_dir), [ps[1]], plain)[0]}
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
           "drafter": OracleDrafter(truth, wrong_every=3)}
    llm = make_llm(llama_dir, speculative_config=cfg)
    outs = llm.generate(ps, [miro, plain], use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in outs] == [truth[tuple(p)] for p in ps]
    assert outs[0].metrics.num_draft_tokens == 0
    assert outs[1].metrics.num_accepted_tokens > 0

    llm = make_llm(llama_dir, async_scheduling=True)
    assert generate(llm, [ps[0]], miro)[0] == truth[tuple(ps[0])]
    assert llm.engine.stats["overlapped_steps"] == 0
    generate(llm, [ps[1]], plain)
    assert llm.engine.stats["overlapped_steps"] > 0                           # back on without Mirostat


def test_proposals_for_a_mirostat_sequence_are_dropped_by_the_scheduler(llama_dir):
    from leapdecode.spec.tree import DraftTree
    llm = make_llm(llama_dir)
    eng = llm.engine
    eng.add_request("m", prompts(1)[0], SamplingParams(mirostat=2, seed=1, max_tokens=4, ignore_eos=True))
    eng.step()                                                    # prefill: the first token
    (seq,) = eng.requests["m"].seqs
    assert seq.is_decoding and eng.scheduler.draft_room(seq) == 0
    plan = eng.scheduler.schedule({seq.seq_id: DraftTree.of([7, 8])})
    assert not plan.seqs[0].draft


def test_mirostat_under_a_grammar(llama_dir):
    """The grammar's mask comes first, Mirostat truncates what it allows; forced tokens are sampled one by one."""
    pytest.importorskip("llguidance")
    llm = make_llm(llama_dir)
    outs = llm.generate(["Pick:"] * 3, [SamplingParams(mirostat=2, mirostat_tau=2.0, seed=s, max_tokens=20,
                                                       structured={"type": "choice", "choice": ["yes", "no"]})
                                        for s in range(3)], use_tqdm=False)
    assert all(o.outputs[0].text in ("yes", "no") for o in outs)


@pytest.mark.parametrize("kw,field", [
    (dict(mirostat=3), "mirostat"), (dict(mirostat=-1), "mirostat"), (dict(mirostat=True), "mirostat"),
    (dict(mirostat=2.0), "mirostat"), (dict(mirostat="2"), "mirostat"),
    (dict(mirostat=2, mirostat_tau=0.0), "mirostat_tau"), (dict(mirostat=2, mirostat_tau=-1), "mirostat_tau"),
    (dict(mirostat=2, mirostat_tau=float("inf")), "mirostat_tau"),
    (dict(mirostat=2, mirostat_tau=float("nan")), "mirostat_tau"), (dict(mirostat_tau="5"), "mirostat_tau"),
    (dict(mirostat=2, mirostat_eta=0), "mirostat_eta"), (dict(mirostat=1, mirostat_eta=float("inf")), "mirostat_eta"),
    (dict(mirostat=2, top_k=40), "top_k"), (dict(mirostat=1, top_k=1), "top_k"),
    (dict(mirostat=2, top_p=0.9), "top_p"), (dict(mirostat=2, min_p=0.05), "min_p"),
    (dict(mirostat=2, temperature=0.0), "temperature"), (dict(mirostat=1, temperature=1e-7), "temperature"),
    (dict(mirostat=2, structured={"type": "json_object"}, grammar_aligned=True), "grammar_aligned"),
])
def test_bad_parameters_name_the_field(kw, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert e.value.param == field and f"SamplingParams.{field}" in str(e.value)


def test_off_values_are_accepted():
    assert SamplingParams(top_k=40, top_p=0.9, temperature=0.0).mirostat == 0
    sp = SamplingParams(mirostat=2, top_k=-1, top_p=1.0, min_p=0.0, mirostat_tau=1e-3, mirostat_eta=10)
    assert sp.mirostat_tau == 1e-3
