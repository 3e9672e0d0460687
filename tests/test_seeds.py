"""Seeds hold with speculation: a seeded request's sampled tokens are exactly plain decoding's, whatever the drafts,
the batch around it or the caches, because each position draws from a uniform keyed by (seed, sample index,
position) instead of from a stream that verification rows consume (sampling/sampler.py)."""
import random

import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.sampling.sampler import Row, SamplingBatch, inverse_cdf_sample, seeded_uniform

VOCAB = 384


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def tokens(outs):
    return [[o.token_ids for o in r.outputs] for r in outs]


def run(path, ps, params, drafter=None, k=5, seed=0, **kw):
    cfg = None if drafter is None else {"method": "ngram", "num_speculative_tokens": k, "adaptive": False,
                                        "drafter": drafter}
    llm = make_llm(path, speculative_config=cfg, seed=seed, **kw)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert_pool_free(llm)
    return llm, tokens(outs)


SEEDED = [SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.2, min_p=0.01, seed=-2**63 + 5, max_tokens=18, ignore_eos=True, n=2)]


@pytest.mark.parametrize("tree", [False, True])
def test_seeded_output_identical_with_speculation_alone(llama_dir, tree):
    ps = prompts(3, seed=1)
    for p, params in zip(ps, SEEDED):
        _, plain = run(llama_dir, [p], params)
        oracle = OracleDrafter({tuple(p): plain[0]}, wrong_every=3, tree=tree)
        llm, spec = run(llama_dir, [p], params, drafter=oracle)
        assert spec == plain
        assert llm.engine.stats["accepted_tokens"] > 0, llm.engine.stats
        assert llm.engine.stats["draft_tokens"] > llm.engine.stats["accepted_tokens"]   # rejections too


def test_seeded_output_identical_with_speculation_in_a_batch(llama_dir):
    """Seeded requests (n=1 and n=2) among unseeded sampled and greedy ones, in a batch that changes under them
    (different engine seeds, chunked prefill, a small KV pool that forces preemption)."""
    ps = prompts(9, seed=2)
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    params = [SEEDED[i % 3] if i % 2 == 0 else others[i % 4 // 2] for i in range(len(ps))]
    seeded = [i for i, sp in enumerate(params) if sp.seed is not None]
    alone = {i: run(llama_dir, [ps[i]], params[i])[1][0] for i in seeded}
    truth = {tuple(ps[i]): alone[i] for i in seeded}
    oracle = OracleDrafter(truth, wrong_every=3)
    llm, mixed = run(llama_dir, ps, params, drafter=oracle, seed=5, max_num_batched_tokens=32, num_kv_blocks=24, max_model_len=64,
                     block_size=4)
    assert {i: mixed[i] for i in seeded} == alone
    assert llm.engine.stats["accepted_tokens"] > 0, llm.engine.stats
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(len(set(map(tuple, mixed[i]))) == 2 for i in seeded if params[i].n == 2)   # n=2: two samples
    _, plain_mixed = run(llama_dir, ps, params, seed=9)
    assert {i: plain_mixed[i] for i in seeded} == alone


def test_same_seed_same_text_with_a_real_drafter(llama_dir):
    """The issue's report: identical seed=1234 requests with the suffix drafter gave different texts."""
    p = prompts(1, seed=3)[0]
    text = (p * 3)[:60]                                      # copy-heavy, so the suffix drafter proposes
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    _, plain = run(llama_dir, [text], params)
    llm = make_llm(llama_dir, speculative_config={"method": "suffix", "num_speculative_tokens": 6,
                                                     "adaptive": False})
    outs = tokens(llm.generate([text] * 3, params, use_tqdm=False))
    assert outs == [plain[0]] * 3
    assert llm.engine.stats["draft_tokens"] > 0


def test_keyed_uniforms_depend_only_on_seed_index_position():
    us = {(s, i, p): seeded_uniform(s, i, p) for s in (0, 1, 1234, -1, 2**63 - 1) for i in (0, 1) for p in range(50)}
    assert all(0.0 <= u < 1.0 for u in us.values())
    assert len(set(us.values())) == len(us)
    assert seeded_uniform(1234, 0, 7) == seeded_uniform(1234, 0, 7)
    # roughly uniform (a bad hash clusters)
    many = [seeded_uniform(3, 0, p) for p in range(4000)]
    hist = torch.histc(torch.tensor(many), bins=10, min=0, max=1)
    assert hist.min() > 320 and hist.max() < 480


class _Seq:
    """What the sampler reads from a sequence."""

    def __init__(self, token_ids, seed, index=0, placeholders=0):
        self.token_ids, self.index, self.num_placeholders = token_ids, index, placeholders
        self.num_output_tokens = len(token_ids) - 1
        self.params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8)


def test_row_uniform_is_keyed_by_the_position_it_draws():
    """A verification row after draft path h draws position len(tokens) + len(h), the same u plain decoding uses
    there; in an overlapped step (one token still in flight) the position counts that placeholder."""
    plain = SamplingBatch([Row(_Seq([5, 6, 7, 8], 11), ())], VOCAB, torch.device("cpu"), set())
    spec = SamplingBatch([Row(_Seq([5, 6], 11), ()), Row(_Seq([5, 6], 11), (7,)), Row(_Seq([5, 6], 11), (7, 8))],
                         VOCAB, torch.device("cpu"), set())
    inflight = SamplingBatch([Row(_Seq([5, 6, 7], 11, placeholders=2), ())], VOCAB, torch.device("cpu"), set())
    g = torch.Generator().manual_seed(0)
    assert spec.uniforms(default=g)[2].item() == plain.uniforms(default=g)[0].item() == seeded_uniform(11, 0, 4)
    assert inflight.uniforms(default=g)[0].item() == seeded_uniform(11, 0, 4)


def test_inverse_cdf_matches_a_float64_reference_and_skips_zero_mass():
    g = torch.Generator().manual_seed(0)
    for V in (8, 256, 300, 5000):
        p = torch.rand(64, V, generator=g) ** 6
        p[p < 0.2] = 0
        p[:, V // 3] += 0.5
        u = torch.rand(64, dtype=torch.float64, generator=g)
        u[0], u[1] = 0.0, 1 - 2 ** -53
        got = inverse_cdf_sample(p, u)
        c = p.double().cumsum(1)
        ref = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True).squeeze(1)
        assert (p[torch.arange(64), got] > 0).all()
        assert torch.equal(got[2:], ref[2:])
