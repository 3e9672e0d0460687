"""Contrastive search (decoding/contrastive.py) against a reference written here from the paper's equations (Su et
al. 2022, eq. 5), run on the tiny random llama through transformers: float32, no KV cache, the whole sequence
through the model again for every candidate."""
import random

import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.errors import InvalidParameter

PROMPTS = [[5, 9, 20, 33, 7],                                   # shorter than a KV block (16)
           [17, 250, 3, 99, 41, 8, 120, 64, 7, 301, 11],
           list(range(40, 77)),                                 # longer: three blocks
           [random.Random(1).randrange(2, 384) for _ in range(23)]]
MAX_TOKENS = 12
EOS = 1


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


@torch.no_grad()
def reference(model, prompt, alpha, k, max_tokens, eos=(EOS,), repetition_penalty=1.0, min_tokens=0):
    """x_t = argmax over the top-k tokens v of p(.|x_<t) of (1 - alpha) p(v|x_<t) - alpha max_j cos(h_v, h_j): h the
    last hidden state (after the final norm), h_v computed with v appended, h_j over every previous token; p the
    softmax of the processed logits (transformers' repetition penalty, eos masked before min_tokens); ties to the
    first. -> (tokens, logprob of each under the raw logits)."""
    ids = list(prompt)
    out = model(torch.tensor([ids]), output_hidden_states=True)
    context, logits = out.hidden_states[-1][0], out.logits[0, -1]
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        processed = logits.clone()
        if repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            x = processed[seen]
            processed[seen] = torch.where(x > 0, x / repetition_penalty, x * repetition_penalty)
        if len(tokens) < min_tokens:
            processed[list(eos)] = -float("inf")
        probs, cands = processed.softmax(-1).topk(k)
        o = model(torch.tensor([ids + [v] for v in cands.tolist()]), output_hidden_states=True)
        h = o.hidden_states[-1][:, -1]                                      # [k, H]: each candidate's state
        penalty = (unit(h) @ unit(context).T).max(-1).values                # max cosine to every previous token
        j = int(((1 - alpha) * probs - alpha * penalty).argmax())           # torch: the first maximum
        v = int(cands[j])
        tokens.append(v)
        logprobs.append(float(logits.log_softmax(-1)[v]))
        ids.append(v)
        context, logits = torch.cat([context, h[j:j + 1]]), o.logits[j, -1]
        if v in eos:
            break
    return tokens, logprobs


def hf(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def cs(alpha=0.6, k=4, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(penalty_alpha=alpha, top_k=k, **kw)


@pytest.fixture(scope="module")
def model(llama_dir):
    return hf(llama_dir)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir)


@pytest.fixture(scope="module")
def refs(model):
    """(prompt index, alpha, k) -> the reference tokens, computed once."""
    cache = {}

    def get(i, alpha, k):
        if (i, alpha, k) not in cache:
            cache[i, alpha, k] = reference(model, PROMPTS[i], alpha, k, MAX_TOKENS)[0]
        return cache[i, alpha, k]
    return get


@pytest.mark.parametrize("alpha", [0.4, 0.6])
@pytest.mark.parametrize("k", [2, 4, 5])
def test_equals_the_reference_and_differs_from_greedy(llm, refs, alpha, k):
    outs = llm.generate(PROMPTS, cs(alpha, k), use_tqdm=False)
    want = [refs(i, alpha, k) for i in range(len(PROMPTS))]
    assert tokens(outs) == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    greedy = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False))
    assert all(g != w for g, w in zip(greedy, want))                 # the feature is really on
    assert not llm.engine.contrastive._states                          # every state freed
    assert llm.engine.stats["draft_tokens"] == 0                       # candidates are not counted as drafts
    assert_pool_free(llm)


def test_eos_ends_the_search(tiny_dir, refs, model):
    """A checkpoint whose eos is a token the search chooses mid-way: it stops there with "stop", as the reference."""
    ref = refs(2, 0.6, 4)
    eos = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
    path = tiny_dir("llama", eos_token_id=eos)                          # same seed: the same weights
    llm = make_llm(path)
    outs = llm.generate(PROMPTS, cs(0.6, 4), use_tqdm=False)
    want = [reference(model, p, 0.6, 4, MAX_TOKENS, eos=(EOS, eos))[0] for p in PROMPTS]
    assert tokens(outs) == want
    assert outs[2].outputs[0].token_ids[-1] == eos and outs[2].outputs[0].finish_reason == "stop"
    # min_tokens masks eos out of the candidates until then
    late = llm.generate(PROMPTS[2], cs(0.6, 4, min_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    assert late == reference(model, PROMPTS[2], 0.6, 4, MAX_TOKENS, eos=(EOS, eos), min_tokens=8)[0]
    assert late[:len(want[2])] != want[2]
    assert_pool_free(llm)


def test_penalties_and_logprobs_follow_the_processed_and_raw_rows(llm, model):
    """p in the score is after the request's logits processing (here transformers' repetition penalty); the
    reported logprobs are the raw model's at the row that predicted the token, as for every other request."""
    outs = llm.generate(PROMPTS[:2], cs(0.6, 4, repetition_penalty=1.5, logprobs=2), use_tqdm=False)
    changed = False
    for p, out in zip(PROMPTS, outs):
        want, lps = reference(model, p, 0.6, 4, MAX_TOKENS, repetition_penalty=1.5)
        changed |= want != reference(model, p, 0.6, 4, MAX_TOKENS)[0]
        got = out.outputs[0]
        assert got.token_ids == want
        assert [e[t] for e, t in zip(got.logprobs, got.token_ids)] == pytest.approx(lps, abs=1e-4)
        assert all(len(e) in (2, 3) for e in got.logprobs)
    assert changed                                                      # the penalty mattered on these prompts
    assert_pool_free(llm)


def test_batch_with_ordinary_requests_and_a_chunked_prompt_equals_each_alone(llama_dir, llm):
    long_prompt = [random.Random(2).randrange(2, 384) for _ in range(70)]
    prompts = PROMPTS + [long_prompt, PROMPTS[1], long_prompt, PROMPTS[3]]
    params = [cs(0.6, 4), cs(0.4, 2), cs(0.6, 5), cs(0.4, 4, max_tokens=20, prompt_logprobs=1), cs(0.6, 4),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS)]
    alone = [tokens(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    small = make_llm(llama_dir, max_num_batched_tokens=24)            # the long prompt takes several steps
    assert tokens(small.generate(prompts, params, use_tqdm=False)) == alone
    assert_pool_free(small)
    # a budget that cuts candidates off (the second request's tree is trimmed, so it waits for a whole step)
    tight = make_llm(llama_dir, max_num_batched_tokens=7)
    assert tokens(tight.generate(PROMPTS[:3], [cs(0.6, 4)] * 3, use_tqdm=False)) == alone[:1] + [
        tokens(llm.generate([p], cs(0.6, 4), use_tqdm=False))[0] for p in PROMPTS[1:3]]
    assert_pool_free(tight)


def test_preemption_in_a_tiny_pool_keeps_the_tokens(llama_dir, refs):
    llm = make_llm(llama_dir, num_kv_blocks=10, max_model_len=128)    # 160 tokens for four sequences of ~50
    outs = llm.generate(PROMPTS * 2, cs(0.6, 4), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == [refs(i, 0.6, 4) for i in range(len(PROMPTS))] * 2
    assert_pool_free(llm)
    assert not llm.engine.contrastive._states


def test_prefix_cache_hits_are_not_adopted(llm, refs):
    """The context needs every prompt token's hidden state, so cached blocks are recomputed, not adopted."""
    llm.generate(PROMPTS[2:3], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # caches blocks
    hits = llm.engine.block_manager.hits
    assert tokens(llm.generate(PROMPTS[2:3], cs(0.6, 4), use_tqdm=False)) == [refs(2, 0.6, 4)]
    assert llm.engine.block_manager.hits == hits
    assert_pool_free(llm)


def test_async_scheduling_and_speculation_leave_it_alone(llama_dir, refs):
    """The overlapped step falls back to the synchronous one; a drafter is never asked for these sequences."""
    asynchronous = make_llm(llama_dir, async_scheduling=True)
    assert tokens(asynchronous.generate(PROMPTS, cs(0.6, 4), use_tqdm=False)) == [refs(i, 0.6, 4) for i in range(4)]
    assert_pool_free(asynchronous)

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    truth = {tuple(p): [t] for p, t in zip(PROMPTS, tokens(make_llm(llama_dir).generate(PROMPTS, greedy,
                                                                                         use_tqdm=False)))}

    class Recording(OracleDrafter):
        def __init__(self, truth):
            super().__init__(truth)
            self.asked = set()

        def propose(self, requests):
            self.asked |= {r.seq_id for r in requests}
            return super().propose(requests)

    drafter = Recording(truth)
    llm = make_llm(llama_dir, speculative_config={"method": "ngram", "adaptive": False, "drafter": drafter})
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"cs{i}", p, cs(0.6, 4))
        eng.add_request(f"g{i}", p, greedy)
    mine = {s.seq_id for s in eng.seqs.values() if s.request_id.startswith("cs")}
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    assert [done[f"cs{i}"] for i in range(4)] == [refs(i, 0.6, 4) for i in range(4)]
    assert [done[f"g{i}"] for i in range(4)] == [truth[tuple(p)][0] for p in PROMPTS]
    assert drafter.asked and not drafter.asked & mine
    assert eng.stats["accepted_tokens"] > 0
    assert_pool_free(llm)


def test_abort_frees_the_state_and_blocks(llm):
    eng = llm.engine
    eng.add_request("a", PROMPTS[2], cs(0.6, 4, max_tokens=30))
    for _ in range(4):
        eng.step()
    assert len(eng.contrastive._states) == 1
    assert eng.abort("a")
    assert not eng.contrastive._states
    assert_pool_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(penalty_alpha=-0.1, top_k=4), "penalty_alpha"),
    (dict(penalty_alpha=1.5, top_k=4), "penalty_alpha"),
    (dict(penalty_alpha=float("nan"), top_k=4), "penalty_alpha"),
    (dict(penalty_alpha="0.6", top_k=4), "penalty_alpha"),
    (dict(penalty_alpha=True, top_k=4), "penalty_alpha"),
    (dict(penalty_alpha=0.6), "top_k"),                                # no candidates: top_k is off by default
    (dict(penalty_alpha=0.6, top_k=0), "top_k"),
    (dict(penalty_alpha=0.6, top_k=4, n=2), "n"),
    (dict(penalty_alpha=0.6, top_k=4, structured={"type": "json_object"}), "structured"),
])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value)


def test_engine_limits_name_the_field(llama_dir, llm):
    with pytest.raises(InvalidParameter) as e:
        llm.generate(PROMPTS[0], cs(0.6, 400), use_tqdm=False)         # more candidates than the vocabulary
    assert e.value.param == "top_k"
    small_budget = make_llm(llama_dir, max_num_batched_tokens=8)
    with pytest.raises(InvalidParameter) as e:
        small_budget.generate(PROMPTS[0], cs(0.6, 8), use_tqdm=False)   # the last token + 8 candidates > 8
    assert e.value.param == "top_k" and "max_num_batched_tokens" in str(e.value)
    tiny_pool = make_llm(llama_dir, num_kv_blocks=8, max_model_len=128)
    with pytest.raises(InvalidParameter) as e:
        tiny_pool.generate(PROMPTS[0], cs(0.6, 4, max_tokens=None), use_tqdm=False)   # 127 + 4 slots > 128
    assert e.value.param == "top_k"
    assert tokens(tiny_pool.generate(PROMPTS[0], cs(0.6, 4), use_tqdm=False))     # a shorter one fits
    for engine_llm in (llm, small_budget, tiny_pool):
        assert_pool_free(engine_llm)
    assert SamplingParams(penalty_alpha=0.6, top_k=1).greedy                        # one candidate: plain greedy
    assert not SamplingParams(penalty_alpha=0.6, top_k=1).contrastive
