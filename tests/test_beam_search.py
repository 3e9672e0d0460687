"""Beam search and diverse beam search: transformers' ``generate(num_beams=...)`` is the reference for the beams,
their scores and their order; diverse beam search (gone from transformers 5) against a loop written here from the
paper's rule over transformers' logits; beams share KV blocks; beams survive preemption and batching."""
from collections import Counter

import pytest
import torch

from conftest import assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.decoding.beam_search import BeamSearchParams

PROMPTS = ["Once upon a time", "def add(a, b):\n    return a", "The quick brown fox jumps over the lazy dog. " * 2]


@pytest.fixture(scope="module")
def setup(llama_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    return make_llm(llama_dir, num_kv_blocks=512), hf, tok


def hf_beams(hf, ids, w, n, **kw):
    out = hf.generate(torch.tensor([ids]), num_beams=w, num_return_sequences=w, max_new_tokens=n, do_sample=False,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=1, **kw)
    return [row[len(ids):] for row in out.sequences.tolist()], out.sequences_scores.tolist()


def frequent_token(llm, ids):
    """A token the beams produce often: made a stop token, it ends beams early (the random model's eos is rare)."""
    out = llm.beam_search([ids], BeamSearchParams(beam_width=4, max_tokens=12))[0]
    counts = Counter(t for s in out.sequences for t in s.output_token_ids[1:])
    return counts.most_common(1)[0][0]


def assert_same_beams(out, ref_tokens, ref_scores):
    mine = [s.output_token_ids for s in out.sequences]
    assert len(mine) == len(ref_tokens)
    for m, r in zip(mine, ref_tokens):
        assert r[:len(m)] == m and all(t == 1 for t in r[len(m):])   # transformers pads a short beam
    assert [s.score for s in out.sequences] == pytest.approx(ref_scores, abs=2e-4)


@pytest.mark.parametrize("prompt,w,n,length_penalty,early_stopping", [
    (0, 2, 8, 1.0, False), (1, 4, 12, 1.0, False), (2, 4, 12, 0.5, True), (0, 3, 10, 2.0, "never"),
    (1, 4, 10, -1.0, False), (2, 5, 9, 1.0, True), (2, 4, 12, 1.0, False)])
def test_beams_equal_transformers(setup, prompt, w, n, length_penalty, early_stopping):
    llm, hf, tok = setup
    ids = tok.encode(PROMPTS[prompt])
    out = llm.beam_search(ids, BeamSearchParams(beam_width=w, max_tokens=n, length_penalty=length_penalty,
                                                early_stopping=early_stopping))[0]
    assert_same_beams(out, *hf_beams(hf, ids, w, n, length_penalty=length_penalty, early_stopping=early_stopping))
    assert all(s.tokens == ids + s.output_token_ids for s in out.sequences)
    assert_pool_free(llm)


def test_width_one_is_greedy(setup):
    llm, _, tok = setup
    ids = tok.encode(PROMPTS[1])
    out = llm.beam_search(ids, BeamSearchParams(beam_width=1, max_tokens=10))[0]
    greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert [s.output_token_ids for s in out.sequences] == [greedy.token_ids]


@pytest.mark.parametrize("prompt,early_stopping", [(0, False), (1, True), (2, "never"), (2, False)])
def test_stop_tokens_end_beams_as_transformers_eos(setup, prompt, early_stopping):
    llm, hf, tok = setup
    ids = tok.encode(PROMPTS[prompt])
    stop = frequent_token(llm, ids)
    params = BeamSearchParams(beam_width=4, max_tokens=14, stop_token_ids=[stop], early_stopping=early_stopping)
    out = llm.beam_search(ids, params)[0]
    ref = hf_beams(hf, ids, 4, 14, eos_token_id=[1, stop], early_stopping=early_stopping)
    assert_same_beams(out, *ref)
    assert any(s.finish_reason == "stop" and s.output_token_ids[-1] == stop for s in out.sequences)
    # min_tokens: stop tokens are masked until then (transformers' min_new_tokens)
    out = llm.beam_search(ids, BeamSearchParams(beam_width=4, max_tokens=14, stop_token_ids=[stop], min_tokens=5,
                                                early_stopping=early_stopping))[0]
    assert_same_beams(out, *hf_beams(hf, ids, 4, 14, eos_token_id=[1, stop], min_new_tokens=5,
                                     early_stopping=early_stopping))
    assert all(len(s.output_token_ids) > 5 for s in out.sequences)
    assert_pool_free(llm)


def diverse_reference(hf, ids, w, groups, penalty, n, stop_ids=(1,)):
    """Diverse beam search (Vijayakumar et al. 2018) written plainly: transformers' logits for each beam's whole
    sequence each step, groups choosing in order, group g's log-probs lowered by ``penalty`` times the number of
    times each token was chosen by earlier groups this step; the beam rules of transformers per group (length
    penalty 1, early_stopping False)."""
    size = w // groups
    k = max(2, 1 + len(stop_ids)) * size
    state = [{"beams": [(list(ids), 0.0)], "hyps": [], "done": False} for _ in range(groups)]
    for step in range(1, n + 1):
        chosen = Counter()
        for g in state:
            if g["done"]:
                continue
            cands = []
            for seq, score in g["beams"]:
                with torch.no_grad():
                    lp = hf(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)
                vals, idx = lp.topk(k)
                cands += [(score + v - penalty * chosen[t], seq, t) for v, t in zip(vals.tolist(), idx.tolist())]
            cands = sorted(cands, key=lambda c: -c[0])[:k]
            hit = [step >= n or t in stop_ids for _, _, t in cands]
            g["hyps"] += [(s / step, seq[len(ids):] + [t]) for (s, seq, t), h in zip(cands[:size], hit[:size]) if h]
            g["hyps"] = sorted(g["hyps"], key=lambda h: -h[0])[:size]
            nxt = [(seq + [t], s) for (s, seq, t), h in zip(cands, hit) if not h][:size]
            if all(hit) or (len(g["hyps"]) == size and nxt[0][1] / step <= g["hyps"][-1][0]):
                g["done"] = True
                continue
            g["beams"] = nxt
            chosen.update(seq[-1] for seq, _ in nxt)
    return sorted((h for g in state for h in g["hyps"]), key=lambda h: -h[0])


@pytest.mark.parametrize("w,groups,penalty", [(4, 2, 0.5), (6, 3, 1.5), (4, 4, 0.8), (4, 2, 0.0)])
def test_diverse_beam_search_equals_the_papers_rule(setup, w, groups, penalty):
    llm, hf, tok = setup
    ids = tok.encode(PROMPTS[0])
    ref = diverse_reference(hf, ids, w, groups, penalty, 8)
    out = llm.beam_search(ids, BeamSearchParams(beam_width=w, max_tokens=8, num_beam_groups=groups,
                                                diversity_penalty=penalty))[0]
    assert [s.output_token_ids for s in out.sequences] == [h[1] for h in ref]
    assert [s.score for s in out.sequences] == pytest.approx([h[0] for h in ref], abs=2e-4)
    if penalty >= 0.8:     # the penalty at work: groups start apart (the plain search's beams share a start)
        firsts = [s.output_token_ids[0] for s in out.sequences]
        assert len(set(firsts)) > 1
    assert_pool_free(llm)


def test_beams_share_kv_blocks(llama_dir, tiny_dir):
    """Peak pool use of one width-4 search over a 100-token prompt vs 4 independent requests (prefix caching off
    for both, so only the beams' copy-on-write sharing counts)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 12)[:100]
    llm = make_llm(llama_dir, num_kv_blocks=256, enable_prefix_caching=False)
    engine, bm = llm.engine, llm.engine.block_manager

    def peak(add):
        add()
        top = 0
        while engine.has_unfinished():
            engine.step()
            top = max(top, bm.num_blocks - bm.num_free_blocks)
        assert_pool_free(llm)
        return top

    beams = peak(lambda: engine.add_beam_request("b", ids, BeamSearchParams(beam_width=4, max_tokens=24)))
    alone = peak(lambda: [engine.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True)) for i in range(4)])
    blocks_prompt = -(-len(ids) // 16)
    assert alone >= 4 * blocks_prompt
    assert beams <= blocks_prompt + 4 * 3 and beams < 0.6 * alone


def test_beam_requests_batch_with_others_and_survive_preemption(llama_dir):
    """Several searches and ordinary requests in one batch, on a pool small enough to preempt: the same beams and
    tokens as each alone."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    params = [BeamSearchParams(beam_width=4, max_tokens=20), BeamSearchParams(beam_width=2, max_tokens=16,
                                                                              length_penalty=0.0),
              BeamSearchParams(beam_width=4, max_tokens=12, num_beam_groups=2, diversity_penalty=1.0)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    solo = make_llm(llama_dir)
    want = [solo.beam_search(p, bp)[0] for p, bp in zip(prompts, params)]
    want_greedy = [solo.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    llm = make_llm(llama_dir, num_kv_blocks=16, max_num_batched_tokens=24)
    engine = llm.engine
    for i, (p, bp) in enumerate(zip(prompts, params)):
        engine.add_beam_request(f"b{i}", p, bp)
        engine.add_request(f"g{i}", p, greedy)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.scheduler.num_preemptions > 0
    for i in range(len(prompts)):
        got = done[f"b{i}"].outputs
        assert [c.token_ids for c in got] == [s.output_token_ids for s in want[i].sequences]
        assert [c.cumulative_logprob for c in got] == pytest.approx([s.cum_logprob for s in want[i].sequences],
                                                                   abs=1e-4)
        assert done[f"g{i}"].outputs[0].token_ids == want_greedy[i]
    assert_pool_free(llm)


def test_abort_mid_search_frees_everything(setup):
    llm, _, tok = setup
    engine = llm.engine
    engine.add_beam_request("x", tok.encode(PROMPTS[2]), BeamSearchParams(beam_width=4, max_tokens=30))
    for _ in range(5):
        engine.step()
    assert len(engine.requests["x"].seqs) == 4
    assert engine.abort("x")
    assert_pool_free(llm)


def test_beam_search_ignores_speculation(llama_dir):
    """Beams take no drafts (each step's choice needs every beam's row): the same beams with a drafter on."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode(PROMPTS[1])
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    plain = make_llm(llama_dir).beam_search(ids, params)[0]
    spec = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    out = spec.beam_search(ids, params)[0]
    assert [s.output_token_ids for s in out.sequences] == [s.output_token_ids for s in plain.sequences]
    assert spec.engine.stats["draft_tokens"] == 0


@pytest.mark.parametrize("field,kw", [
    ("beam_width", dict(beam_width=0)), ("beam_width", dict(beam_width=2.5)), ("max_tokens", dict(max_tokens=0)),
    ("length_penalty", dict(length_penalty=float("nan"))), ("early_stopping", dict(early_stopping="sometimes")),
    ("num_beam_groups", dict(num_beam_groups=3)), ("diversity_penalty", dict(diversity_penalty=1.0)),
    ("diversity_penalty", dict(num_beam_groups=2, diversity_penalty=-1.0)), ("min_tokens", dict(min_tokens=99)),
    ("stop_token_ids", dict(stop_token_ids=[-1]))])
def test_bad_parameters_name_the_field(field, kw):
    kw = {"beam_width": 4, **kw}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kw)


def test_engine_limits_name_the_field(setup):
    llm, _, tok = setup
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.beam_search("hi", BeamSearchParams(beam_width=2, stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="beam_width"):
        small = make_llm(llm.engine.cfg.model, num_kv_blocks=8, max_model_len=128)
        small.beam_search("hi", BeamSearchParams(beam_width=8, max_tokens=200))
    assert_pool_free(llm)
