"""DoLa (layer-contrastive decoding, sampling/dola.py) against a reference written here from the paper's and
transformers 4.x's equations, run on the tiny random llama through transformers itself (full forward each step,
float32); plus its compositions: mixed batches, speculation, grammars, the overlapped step, bad parameters."""
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import OracleDrafter, assert_pool_free, fail_sampling_of, make_llm
from leapdecode import SamplingParams
from leapdecode.errors import InvalidParameter
from leapdecode.sampling.dola import Premature, candidate_layers, contrast

NUM_LAYERS = 10          # "low" and "high" then have three candidates each
MAX_TOKENS = 12
# the candidate layers transformers 4.x takes for a 10-layer model: every second layer of each half, and with
# tied embeddings the lower half starts at layer 2 (the embeddings' early exit is nearly the identity)
EXPECTED = {("llama", "low"): [0, 2, 4], ("llama", "high"): [5, 7, 9], ("llama", (3,)): [3],
            ("llama_tied", "low"): [2, 4]}


def prompts(seed=0, n=4, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def reference_dola(model, prompt, layers, max_tokens, repetition_penalty=1.0):
    """Greedy DoLa, one full forward per token: final logits vs the LM head on each candidate's hidden state
    (transformers' hidden_states[j], no final norm for j < N); the candidate with the largest divergence
    0.5 * (KL(m || p_N) + KL(m || p_j)) (mean over the vocabulary, m the average); the tokens with
    log p_N >= max + log 0.1 get log p_N - log p_M, the others -inf; then HF's repetition penalty and argmax."""
    ids = list(prompt)
    lm_head = model.get_output_embeddings()
    with torch.no_grad():
        for _ in range(max_tokens):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            final = out.logits[0, -1].float().log_softmax(-1)
            best_js, best = None, None
            for j in layers:
                early = lm_head(out.hidden_states[j][0, -1]).float().log_softmax(-1)
                m = 0.5 * (final.exp() + early.exp())
                js = 0.5 * (F.kl_div(final, m, reduction="none").mean()
                            + F.kl_div(early, m, reduction="none").mean())
                if best_js is None or js > best_js:
                    best_js, best = js, early
            keep = final >= final.max() + math.log(0.1)
            scores = torch.where(keep, final - best, torch.tensor(float("-inf")))
            if repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(ids)))
                s = scores[seen]
                scores[seen] = torch.where(s < 0, s * repetition_penalty, s / repetition_penalty)
            ids.append(int(scores.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads; on a shared 2-core machine two threads were measured at 15 ms for
    transformers' [1, 8, 64] x [64, 128] matmul against 5 us with one (the reference runs hundreds of them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dirs(tiny_dir):
    return {arch: tiny_dir(arch, num_hidden_layers=NUM_LAYERS) for arch in ("llama", "llama_tied")}


@pytest.fixture(scope="module")
def hf(dirs):
    from transformers import AutoModelForCausalLM
    return {arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for arch, path in dirs.items()}


@pytest.fixture(scope="module")
def llms(dirs):
    return {arch: make_llm(path) for arch, path in dirs.items()}


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# -- the rule ------------------------------------------------------------------------------------------------------

def test_candidate_layers_follow_transformers():
    for (arch, spec), layers in EXPECTED.items():
        assert list(candidate_layers(spec, NUM_LAYERS, arch == "llama_tied")) == layers
    assert candidate_layers("low", 48, False) == tuple(range(0, 20, 2))          # deep models: at most 20 layers
    assert candidate_layers("high", 48, False) == tuple(range(28, 48, 2))
    assert candidate_layers("low", 48, True) == tuple(range(2, 20, 2))
    assert candidate_layers("low", 2, True) == (1,)                              # shallow tied: layer 1
    assert candidate_layers("low", 4, True) == (2,)                              # start == N // 2
    assert candidate_layers("low", 1, False) == (0,) and candidate_layers("high", 2, False) == (1,)
    assert candidate_layers((4, 2, 4), NUM_LAYERS, False) == (4, 2)
    for spec, n, tied in [((NUM_LAYERS,), NUM_LAYERS, False), ((1, 99), NUM_LAYERS, False), ("low", 3, True)]:
        with pytest.raises(InvalidParameter) as e:
            candidate_layers(spec, n, tied)
        assert e.value.param == "dola_layers"


def test_plausibility_keeps_the_top_token_and_a_grammar_moves_it_to_the_allowed_ones():
    final = torch.tensor([[4.0, 3.0, 0.0, -5.0]])
    premature = torch.tensor([[4.0, 1.0, 0.0, -5.0]]).log_softmax(-1)
    lp = final.log_softmax(-1)
    out = contrast(final, premature)
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()     # p(2)/p(0) = e^-4 < 0.1
    assert torch.allclose(out[0, :2], (lp - premature)[0, :2])
    assert out.argmax().item() == 1                                               # the contrast flips the top
    masked = final.clone()
    masked[0, :2] = float("-inf")                                                 # a grammar forbids both
    out = contrast(final, premature, masked)
    assert torch.isinf(out[0, [0, 1, 3]]).all() and torch.isfinite(out[0, 2])     # token 2 is the allowed top
    p = Premature((1,), premature, (5,))                                          # only sample row 1 is DoLa
    rows = torch.cat([final, final])
    applied = p.apply(rows, rows)
    assert torch.equal(applied[0], final[0]) and torch.equal(applied[1], contrast(final, premature)[0])


# -- against the reference -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,spec", [("llama", "high"), ("llama", "low"), ("llama", (3,)), ("llama_tied", "low")])
@pytest.mark.parametrize("penalty", [1.0, 1.2])
def test_greedy_equals_the_reference(llms, hf, arch, spec, penalty):
    ps = prompts()
    ref = [reference_dola(hf[arch], p, EXPECTED[arch, spec], MAX_TOKENS, penalty) for p in ps]
    outs = llms[arch].generate(ps, greedy(dola_layers=spec, repetition_penalty=penalty), use_tqdm=False)
    assert tokens(outs) == ref
    # the feature switched off fails this test: plain greedy decoding says something else on every prompt
    plain = llms[arch].generate(ps, greedy(repetition_penalty=penalty), use_tqdm=False)
    assert all(a != b for a, b in zip(tokens(plain), ref))
    assert_pool_free(llms[arch])


def test_each_row_chooses_its_own_premature_layer(llms, monkeypatch):
    """The divergence is taken per row: within one step, rows contrast with different layers."""
    llm = llms["llama"]
    seen = []
    real = llm.engine.dola.premature

    def spy(*args, **kw):
        p = real(*args, **kw)
        if p is not None:
            seen.append(p.layers)
        return p

    monkeypatch.setattr(llm.engine.dola, "premature", spy)
    llm.generate(prompts(n=8), greedy(dola_layers="high"), use_tqdm=False)
    assert any(len(set(layers)) > 1 for layers in seen)
    assert {j for layers in seen for j in layers} <= set(EXPECTED["llama", "high"])


# -- compositions ----------------------------------------------------------------------------------------------------

def test_mixed_batch_leaves_other_rows_alone_and_captures_only_for_dola(llms, monkeypatch):
    llm = llms["llama"]
    ps = prompts(seed=1, n=6)
    plain = [greedy(), SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
             greedy(repetition_penalty=1.3)]
    dola = [greedy(dola_layers="high", prompt_logprobs=1),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True,
                           dola_layers="low"),
            greedy(dola_layers=[3], repetition_penalty=1.2, logprobs=2)]
    alone_plain = tokens(llm.generate(ps[:3], plain, use_tqdm=False))
    alone_dola = tokens(llm.generate(ps[3:], dola, use_tqdm=False))
    captures = []
    real = llm.engine.runner.execute

    def spy(plan, *args, **kw):
        captures.append(kw.get("capture", ()))
        return real(plan, *args, **kw)

    monkeypatch.setattr(llm.engine.runner, "execute", spy)
    llm.generate(ps[:3], plain, use_tqdm=False)
    assert captures and all(c == () for c in captures)                 # no DoLa request: no hidden states
    mixed = llm.generate(ps, plain + dola, use_tqdm=False)
    assert tokens(mixed) == alone_plain + alone_dola
    assert {j for c in captures for j in c} == {0, 2, 3, 4, 5, 7, 9}
    out = mixed[5].outputs[0]                       # logprobs stay the model's own: finite, for the chosen token
    assert len(out.logprobs) == MAX_TOKENS and all(math.isfinite(e[t]) and e[t] <= 0 and len(e) >= 2
                                                   for e, t in zip(out.logprobs, out.token_ids))
    assert_pool_free(llm)


def test_a_fault_in_another_request_leaves_dola_rows_intact(llms, monkeypatch):
    """When sampling the batch raises, each sequence is sampled alone with its own rows of the contrast."""
    llm = llms["llama"]
    ps = prompts(seed=4, n=3)
    params = [greedy(dola_layers="high"), greedy(dola_layers="low", repetition_penalty=1.2), greedy()]
    alone = tokens(llm.generate(ps, params, use_tqdm=False))
    fail_sampling_of(monkeypatch, "bad")
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(str(i), p, sp)
    eng.add_request("bad", ps[0], greedy(dola_layers="high"))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.outputs[0] for o in eng.step() if o.finished})
    assert [done[str(i)].token_ids for i in range(len(ps))] == alone
    assert done["bad"].finish_reason == "error"
    assert_pool_free(llm)


class CapturingOracle(OracleDrafter):
    """An oracle drafter that also asks for hidden states of every row (as EAGLE does): DoLa then finds its rows
    among all the tokens of the plan."""
    capture_layers = (NUM_LAYERS,)

    def observe_hidden(self, plan, result, hidden):
        assert hidden[NUM_LAYERS].shape[0] == plan.num_tokens


@pytest.mark.parametrize("drafter", [OracleDrafter, CapturingOracle])
@pytest.mark.parametrize("tree", [False, True])
def test_speculation_verifies_drafts_with_the_same_contrast(dirs, llms, drafter, tree):
    ps = prompts(seed=2, n=5)
    params = [greedy(dola_layers="high"), greedy(dola_layers="low", repetition_penalty=1.2), greedy(),
              greedy(dola_layers=[3]), greedy(dola_layers="high")]
    ref = tokens(llms["llama"].generate(ps, params, use_tqdm=False))
    oracle = drafter({tuple(p): [r] for p, r in zip(ps, ref)}, tree=tree)
    llm = make_llm(dirs["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                      "adaptive": False, "drafter": oracle})
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == ref
    assert llm.engine.stats["accepted_tokens"] > 0 and llm.engine.stats["draft_tokens"] > 0
    assert_pool_free(llm)


def test_overlapped_engine_and_chunked_prefill(dirs, llms):
    """DoLa requests are not overlap-safe (the overlapped step captures no hidden states): the engine runs them
    synchronously; a prompt split into chunks contrasts only at the chunk that samples."""
    ps = prompts(seed=3, n=3)
    params = [greedy(dola_layers="high"), greedy(), greedy(dola_layers="low")]
    llm = make_llm(dirs["llama"], async_scheduling=True, max_num_batched_tokens=8)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == tokens(llms["llama"].generate(ps, params,
                                                                                               use_tqdm=False))
    assert_pool_free(llm)


def test_grammar_applies_after_the_contrast(llms):
    llm = llms["llama"]
    regex = r"[a-c]{2,4}-[0-9]{3}"
    spec = {"type": "regex", "regex": regex}
    outs = llm.generate(["Code:"] * 4, [SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=24,
                                                       structured=spec, dola_layers=("high", "low")[i % 2])
                                        for i in range(4)], use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_pool_free(llm)


# -- bad input -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["mid", "", [], [-1], ["2"], [1.0], [True], 3, {"low": 1}])
def test_bad_dola_layers_name_the_field(value):
    with pytest.raises(ValueError) as e:
        SamplingParams(dola_layers=value)
    assert e.value.param == "dola_layers" and "dola_layers" in str(e.value)


def test_dola_refuses_grammar_alignment_and_layers_the_model_lacks(llms):
    with pytest.raises(ValueError) as e:
        SamplingParams(dola_layers="high", structured={"type": "regex", "regex": "a+"}, grammar_aligned=True)
    assert e.value.param == "grammar_aligned"
    engine = llms["llama"].engine
    for layers in ([NUM_LAYERS], [2, 40]):
        with pytest.raises(InvalidParameter) as e:
            engine.add_request("bad", [5, 6, 7], SamplingParams(dola_layers=layers))
        assert e.value.param == "dola_layers" and str(NUM_LAYERS) in str(e.value)
    assert not engine.requests
    assert SamplingParams(dola_layers=[4, 2]).dola_layers == (4, 2)
