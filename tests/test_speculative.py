"""Speculative decoding is lossless: identical greedy output, identical sampling distribution, no leaked blocks."""
import collections
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import LLM, SamplingParams
from leapdecode.sampling.rejection import verify_with_draft_probs
from leapdecode.spec.controller import Controller, StepTimeModel
from leapdecode.spec.drafter import Draft

METHODS = ["ngram", "suffix", "recycling", "auto"]


def spec(method, k=5, adaptive=False, **options):
    return {"method": method, "num_speculative_tokens": k, "adaptive": adaptive, **options}


def assert_drafts_accepted(llm):
    """The speculation tests are only meaningful if drafts were really verified and some accepted."""
    stats = llm.engine.stats
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def mixed_prompts(seed=0, vocab=384):
    rng = random.Random(seed)
    passage = [rng.randrange(2, vocab) for _ in range(30)]
    copy_heavy = [passage + [7] + passage[:6], passage * 2 + passage[:3]]
    random_ones = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    return copy_heavy + random_ones


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make_llm(llama_dir)
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, params, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", METHODS + ["auto_in_order"])
def test_greedy_identical_for_every_drafter(llama_dir, reference, method):
    prompts, params, ref = reference
    config = spec("auto", fallback=True) if method == "auto_in_order" else spec(method)   # (in order: spec/auto.py)
    llm = make_llm(llama_dir, speculative_config=config)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_drafts_accepted(llm)
    assert_pool_free(llm)


@pytest.mark.parametrize("tree", [False, True])
def test_oracle_drafts_are_accepted_and_output_is_identical(llama_dir, reference, tree):
    prompts, params, ref = reference
    drafter = OracleDrafter({tuple(p): [r] for p, r in zip(prompts, ref)}, tree=tree)
    llm = make_llm(llama_dir, speculative_config=spec("ngram", k=6, drafter=drafter))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert min(o.metrics.mean_accepted_per_step for o in outs) > 1.5
    assert_pool_free(llm)


def test_a_request_that_finishes_on_its_draft_still_teaches_the_controller(llama_dir, reference):
    """The step in which a request ends by accepting its draft is reported to the controller like any other (it is
    the best news a draft brings: left out, at batch 64 with 16-token answers the record held mostly the drafts
    that failed), and not to the drafter, whose request is gone."""
    prompts, params, ref = reference
    drafter = OracleDrafter({tuple(p): [r] for p, r in zip(prompts, ref)}, wrong_every=1000)
    llm = make_llm(llama_dir, speculative_config=spec("ngram", k=6, adaptive=True, drafter=drafter))
    sp = llm.engine.speculator
    sp.guard = None          # its first bare window (after 4 drafting steps) may fall on the requests' last step
    # a flat step-time curve that real steps do not move: the controller's choice then rests on acceptance alone (on
    # measured times, a loaded machine made it verify nothing in the requests' last steps now and then)
    flat = StepTimeModel()
    for n in range(1, 64):
        flat.observe(n, 0.01)
    flat.observe = lambda *args, **kwargs: None
    sp.controller.step_time = flat
    finished, drafter_calls, observed = [], [], []
    real_observe = sp.observe

    def observe(seq, k, accepted, topk):
        observed.append(seq.seq_id)
        if seq.is_finished:
            finished.append((k, accepted))
        real_observe(seq, k, accepted, topk)
    sp.observe = observe
    drafter.observe = lambda seq_id, *a: drafter_calls.append(seq_id)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert len(finished) == len(prompts) and any(k > 0 and a > 0 for k, a in finished), finished
    assert len(drafter_calls) == len(observed) - len(finished)
    assert_pool_free(llm)


def test_stops_limits_n_prefix_cache_and_preemption_inside_drafts(llama_dir, tiny_dir, reference):
    """max_tokens, eos, stop strings and stop ids landing inside an accepted draft; n > 1; a tiny KV pool."""
    prompts, _, ref = reference
    truth = {tuple(p): [r] for p, r in zip(prompts, ref)}
    tok_text = make_llm(llama_dir).get_tokenizer()
    cases = []
    for p, r in zip(prompts, ref):
        text = tok_text.decode(r, skip_special_tokens=True)
        cases += [
            SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[r[9]]),
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[12:15]] if len(text) > 15 else None),
            SamplingParams(n=2, temperature=0.0, max_tokens=25, ignore_eos=True),
        ]
    all_prompts = [p for p in prompts for _ in range(4)]
    plain = make_llm(llama_dir).generate(all_prompts, cases, use_tqdm=False)

    for kw in [dict(), dict(num_kv_blocks=24, block_size=8, max_model_len=128)]:
        llm = make_llm(llama_dir, speculative_config=spec("ngram", k=6, drafter=OracleDrafter(truth)), **kw)
        outs = llm.generate(all_prompts, cases, use_tqdm=False)
        for a, b in zip(outs, plain):
            assert [(o.token_ids, o.text, o.finish_reason) for o in a.outputs] == \
                   [(o.token_ids, o.text, o.finish_reason) for o in b.outputs]
        assert_drafts_accepted(llm)
        # the stops really landed inside drafts: a request ended at a token that was an accepted draft token
        ends_in_draft = [o for o, c in zip(outs, cases) if c.max_tokens == 13 or c.stop_token_ids]
        assert any(o.metrics.num_accepted_tokens and o.metrics.num_steps < len(o.outputs[0].token_ids)
                   for o in ends_in_draft)
        assert_pool_free(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    # eos inside a draft: the same weights with a token of the greedy output declared eos
    eos = ref[0][7]
    llm = make_llm(tiny_dir("llama", eos_token_id=eos),
                   speculative_config=spec("ngram", k=6, drafter=OracleDrafter(truth, wrong_every=100)))
    out = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0][:ref[0].index(eos) + 1] and out.outputs[0].finish_reason == "stop"
    assert out.metrics.num_steps < len(out.outputs[0].token_ids)      # eos arrived as an accepted draft token
    assert_pool_free(llm)


def test_zero_speculative_tokens_is_the_plain_path(llama_dir, reference):
    prompts, params, ref = reference
    llm = make_llm(llama_dir, speculative_config=spec("suffix", k=0))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.stats["draft_tokens"] == 0


def test_adaptive_controller_keeps_output_identical(llama_dir, reference):
    prompts, params, ref = reference
    llm = make_llm(llama_dir, speculative_config=spec("suffix", adaptive=True))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    # how much the controller drafts depends on measured step times; that the drafter was consulted does not
    assert llm.engine.speculator.num_proposals > 0


# -- distribution ------------------------------------------------------------------------------------------------

def exact_pair_distribution(path, prompt, transform):
    """P(t2, t3) of the 2nd and 3rd generated tokens, by enumerating the tiny vocabulary with transformers."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    V = model.config.vocab_size

    def probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1].double()
        return transform(logits).softmax(-1)

    p1 = probs([[]])[0]
    p2 = probs([[a] for a in range(V)])                                    # [t1, t2]
    p3 = probs([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


class GreedyModelDrafter:
    """Drafts the transformers model's own greedy continuation (cached per context): often accepted, sometimes
    not, so both branches of verification are exercised at temperature > 0."""

    def __init__(self, path):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.cache = {}

    def propose(self, requests):
        drafts = []
        for r in requests:
            key = (tuple(r.token_ids), r.max_draft)
            if key not in self.cache:
                ids = torch.tensor([list(r.token_ids)])
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_draft,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
                self.cache[key] = out[0, ids.shape[1]:].tolist()
            drafts.append(Draft(self.cache[key], None, score=0.8))
        return drafts

    def observe(self, *args, **kwargs):
        pass

    def finish(self, *args, **kwargs):
        pass


def chi2_pvalue(samples, expected):
    counts = torch.zeros_like(expected).flatten()
    for t2, t3 in samples:
        counts[t2 * expected.shape[1] + t3] += 1
    exp = expected.flatten() * len(samples)
    big = exp >= 5                                   # pool sparse cells so the test is valid
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    return chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue


@pytest.mark.parametrize("params,transform", [
    (dict(temperature=1.0), lambda l: l),
    (dict(temperature=0.7, top_k=3), lambda l: (l / 0.7).masked_fill(l < l.topk(3, -1).values[..., -1:], -1e30)),
])
def test_sampled_distribution_is_unchanged(tiny_dir, params, transform):
    path = tiny_dir("llama", vocab_size=8, initializer_range=0.6)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = exact_pair_distribution(path, prompt, transform)
    n = 2000
    sp = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    results = {}
    for name, cfg in [("plain", None), ("spec", spec("ngram", k=3, drafter=GreedyModelDrafter(path)))]:
        llm = make_llm(path, speculative_config=cfg, max_num_seqs=1024, seed=11)
        outs = llm.generate([prompt] * n, sp, use_tqdm=False)
        results[name] = chi2_pvalue([o.outputs[0].token_ids[1:3] for o in outs], expected)
        if cfg is not None:
            assert llm.engine.stats["accepted_tokens"] > 0.3 * n      # drafts really were verified and accepted
            assert llm.engine.stats["draft_tokens"] > llm.engine.stats["accepted_tokens"]   # ... and rejected
        assert_pool_free(llm)
    assert results["plain"] > 1e-3 and results["spec"] > 1e-3, results


def test_rejection_with_draft_probs_is_exact():
    """min(1, p/q) acceptance + residual resampling reproduces p exactly (exact enumeration vs samples)."""
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(1, V, generator=g, dtype=torch.float64), -1)
    firsts = []
    for _ in range(6000):
        x = int(torch.multinomial(q[0], 1, generator=g))
        n_acc, nxt = verify_with_draft_probs(p, q, [x], g)
        firsts.append(x if n_acc == 1 else nxt)
    counts = torch.bincount(torch.tensor(firsts), minlength=V).double()
    assert chisquare(counts.numpy(), (p[0] * len(firsts)).numpy()).pvalue > 1e-3


# -- controller --------------------------------------------------------------------------------------------------

def test_controller_speculates_when_cheap_and_accepted_not_when_costly():
    cheap = Controller(8, StepTimeModel(c0=10e-3, c1=1e-5))       # memory-bound GPU-like step
    for _ in range(5):
        cheap.observe(1, 8, 8)
    assert cheap.draft_lengths([(1, 8, 0.9)], other_tokens=1) == [8]
    costly = Controller(8, StepTimeModel(c0=1e-4, c1=1e-3))       # compute-bound: every token costs
    for _ in range(5):
        for i in range(64):
            costly.observe(i, 8, 0)
    assert costly.draft_lengths([(i, 8, 0.1) for i in range(64)], other_tokens=64) == [0] * 64
    # under load, the same acceptance buys fewer draft tokens per request
    light = cheap.draft_lengths([(i, 8, 0.6) for i in range(2)], other_tokens=2)
    heavy = Controller(8, StepTimeModel(c0=10e-3, c1=1e-4)).draft_lengths([(i, 8, 0.6) for i in range(256)], 256)
    assert sum(heavy) / 256 < sum(light) / 2


def test_long_prompt_is_indexed_during_prefill_not_in_the_first_decode_step(llama_dir, monkeypatch):
    """Issue 19 ("no pauses"): while a long prompt is prefilled in chunks the engine hands the prefilled tokens to
    the drafter (`Speculator.prepare`), so no step indexes more than about a chunk; the output is unchanged."""
    from leapdecode.spec import index as index_module
    rng = random.Random(5)
    prompt = [rng.randrange(2, 384) for _ in range(50)] * 4                # 200 tokens that repeat: drafts exist
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = make_llm(llama_dir, max_num_batched_tokens=32)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    from leapdecode.spec.compiled import CompiledIndex
    sizes = []
    for index_type in (index_module.NgramIndex, CompiledIndex):
        monkeypatch.setattr(index_type, "_extend", lambda self, new, original=index_type._extend:
                            (sizes.append(len(new)), original(self, new)))
    llm = make_llm(llama_dir, max_num_batched_tokens=32, speculative_config=spec("suffix"))
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert sum(sizes) >= len(prompt) and max(sizes) <= 32, sizes
    assert_pool_free(llm)


def test_a_quiet_speculator_learns_the_top_k_of_a_few_rows_a_step(llama_dir):
    """While the controller keeps speculation off, the drafter learns the target's top-k from at most
    ``QUIET_TOPK_ROWS`` rows a step, in turn, so every request's rows are learned from now and then (at batch 64 on
    the CPU, every row's top-k and Token Recycling's updates cost ~1.5% of a quiet run); the rows it gets are the
    target's own top-k (the plain run's logprobs), and the output is plain decoding's."""
    from leapdecode.spec.speculator import QUIET_TOPK_ROWS
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(4, 20))] for _ in range(QUIET_TOPK_ROWS + 5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=8)
    plain = make_llm(llama_dir).generate(prompts, params, use_tqdm=False)
    llm = make_llm(llama_dir, speculative_config=spec("recycling", k=4, adaptive=True))
    sp = llm.engine.speculator
    sp.guard = None
    sp.controller.draft_lengths = lambda proposals, *a, **k: [0] * len(proposals)     # drafting never pays
    sp.controller.worth_drafting = lambda *a, **k: False
    learned, step = [], [0]
    real_observe, real_step = sp.drafter.observe, llm.engine.step

    def observe(seq_id, token_ids, num_accepted, topk=None):
        if topk is not None:
            which = next(i for i, p in enumerate(prompts) if list(token_ids[:len(p)]) == p)
            learned.append((step[0], which, len(token_ids), topk[0]))
        real_observe(seq_id, token_ids, num_accepted, topk)

    def engine_step():
        step[0] += 1
        return real_step()
    sp.drafter.observe, llm.engine.step = observe, engine_step
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats["draft_tokens"] == 0 and not sp.speculating
    per_step = collections.Counter(s for s, *_ in learned)
    quiet = [n for s, n in sorted(per_step.items()) if s > 2]      # (the first decode step still drafts for all)
    assert quiet and max(quiet) == QUIET_TOPK_ROWS
    assert {i for _, i, *_ in learned} == set(range(len(prompts)))
    for _, i, length, row in learned:
        entry = plain[i].outputs[0].logprobs[length - 1 - len(prompts[i])]   # the distribution row 0 is of
        top = sorted(entry, key=entry.get, reverse=True)[:8]
        assert set(row) == set(top)
