"""End-to-end engine behaviour against independent references (transformers generate and logits)."""
import random

import pytest
import torch

from conftest import assert_pool_free, fail_sampling_of, make_llm
from leapdecode import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def random_prompts(n, lo=3, hi=60, seed=0, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def token_logprobs(outs):
    """Each output's (token, its log-probability) pairs: what bit-for-bit comparisons compare."""
    return [[(t, lp[t]) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]


def hf_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_generate(tiny_dir, arch):
    path = tiny_dir(arch)
    llm = make_llm(path)
    prompts = random_prompts(4, seed=1) + ["Once upon a time", "def add(a, b):"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    model = hf_model(path)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=1)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].finish_reason == "length"
    assert_pool_free(llm)


def test_batch_invariance_32_mixed_requests(llm):
    prompts = random_prompts(32, seed=2)
    batched = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert_pool_free(llm)


def test_chunked_prefill_equals_unchunked(llama_dir):
    prompts = random_prompts(8, lo=20, hi=90, seed=3)
    ref = tokens(make_llm(llama_dir).generate(prompts, GREEDY, use_tqdm=False))
    chunked = make_llm(llama_dir, max_num_batched_tokens=7)
    assert tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == ref
    assert_pool_free(chunked)


def test_decodes_are_not_stalled_by_long_prefill(llama_dir):
    """Sarathi-Serve: with a small budget, a running decode gets a token every step while a long prompt prefills."""
    llm = make_llm(llama_dir, max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_request("short", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()                                               # prefill the short one
    eng.add_request("long", list(range(2, 200)), GREEDY)
    produced = []
    for _ in range(10):
        for out in eng.step():
            if out.request_id == "short":
                produced.append(len(out.outputs[0].token_ids))
    assert produced == list(range(2, 12))                   # one new token every single step
    while eng.has_unfinished():
        eng.step()
    assert_pool_free(llm)


def test_prefix_cache_hits_equal_cold_runs(llama_dir):
    rng = random.Random(4)
    shared = [rng.randrange(2, 384) for _ in range(70)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    cold = tokens(make_llm(llama_dir, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False))
    warm_llm = make_llm(llama_dir, enable_prefix_caching=True)
    first = tokens(warm_llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    rest = tokens(warm_llm.generate(prompts[1:], GREEDY, use_tqdm=False))
    assert first + rest == cold
    bm = warm_llm.engine.block_manager
    assert bm.hits >= 5 * 64                                 # 4 full blocks of the shared prefix, 5 requests
    # an identical prompt again: everything but the last block comes from the cache
    again = tokens(warm_llm.generate(prompts[:1], GREEDY, use_tqdm=False))
    assert again == cold[:1]
    assert_pool_free(warm_llm)


def test_preemption_keeps_every_request_complete_and_identical(llama_dir):
    """A preempted request recomputes its prompt and output as a prompt chunk: with exact attention (the CPU
    default) that chunk's rows get the bits they got as decodes, so even the log-probabilities are the same."""
    prompts = random_prompts(12, lo=10, hi=40, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    ref = make_llm(llama_dir).generate(prompts, params, use_tqdm=False)
    small = make_llm(llama_dir, num_kv_blocks=16, block_size=8, max_model_len=128)   # 128 tokens of KV in all
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(ref)
    assert all(len(t) == 40 for t in tokens(outs))
    from leapdecode.attention import cpu_exact
    if cpu_exact.kernel() is not None:
        assert token_logprobs(outs) == token_logprobs(ref)
    assert_pool_free(small)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tokens(llm.generate(["The quick brown fox"], p, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(["hello"] * 3 + ["The quick brown fox"] + ["x y z"] * 3,
                         [others] * 3 + [p] + [others] * 3, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    again = tokens(llm.generate(["The quick brown fox"], p, use_tqdm=False))[0]
    assert again == alone


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts(4, seed=6)
    g = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    k1 = tokens(llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True),
                             use_tqdm=False))
    assert g == k1


def test_stop_strings_across_token_boundaries(llm):
    tok = llm.get_tokenizer()
    prompt = "def add(a, b):"
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    ids = ref.outputs[0].token_ids
    # a stop string made of the tail of token 5 and the head of token 6
    t5, t6 = tok.decode(ids[:6]), tok.decode(ids[:7])
    cut = len(tok.decode(ids[:5]))
    start = max(cut, len(t5) - 2)
    stop = t6[start:len(t5) + 2]
    assert len(stop) >= 2 and stop in ref.outputs[0].text
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    expected = ref.outputs[0].text[:ref.outputs[0].text.index(stop)]
    assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
    keep = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop,
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == expected + stop


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [10, 20, 30, 40]
    ids = tokens(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens masks the stop token until enough tokens exist
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id],
                                                min_tokens=first + 3), use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 3] and len(out.token_ids) >= first + 3


def test_penalties_match_a_reference_loop(llama_dir, llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                            presence_penalty=0.7, frequency_penalty=0.4)
    prompt = [7, 8, 9, 7, 8, 9]
    ours = tokens(llm.generate([prompt], params, use_tqdm=False))[0]
    model, seq = hf_model(llama_dir), list(prompt)
    for _ in range(12):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        seen = torch.zeros(384, dtype=torch.bool)
        seen[seq] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.5, logits * 1.5), logits)
        counts = torch.bincount(torch.tensor(seq[len(prompt):] or [0]), minlength=384).float()
        if len(seq) == len(prompt):
            counts.zero_()
        logits = logits - 0.4 * counts - 0.7 * (counts > 0).float()
        seq.append(int(logits.argmax()))
    assert ours == seq[len(prompt):]


def test_logit_bias_matches_a_reference_loop(llama_dir, llm):
    """Biases added to the raw logits before penalties (OpenAI's meaning), with speculation's rows alike: greedy
    under a bias == argmax of transformers' logits plus the bias, step by step; logprobs stay the model's."""
    prompt = [7, 8, 9, 7, 8, 9]
    plain = tokens(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                use_tqdm=False))[0]
    bias = {plain[0]: -100.0, plain[1]: -3.5, 42: 2.5, 77: 1.0}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias=bias, logprobs=1,
                            repetition_penalty=1.3)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    model, seq = hf_model(llama_dir), list(prompt)
    add = torch.zeros(384)
    for t, b in bias.items():
        add[t] += b
    for j in range(10):
        with torch.no_grad():
            raw = model(torch.tensor([seq])).logits[0, -1]
        logits = raw + add
        seen = torch.zeros(384, dtype=torch.bool)
        seen[seq] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
        seq.append(int(logits.argmax()))
        tok = seq[-1]
        assert abs(out.logprobs[j][tok] - raw.log_softmax(-1)[tok].item()) < 1e-4     # the model's logprob
    assert out.token_ids == seq[len(prompt):] != plain
    assert plain[0] not in out.token_ids[:1]
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                   logit_bias={123: 100}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [123] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], SamplingParams(logit_bias={384: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_logprobs_match_transformers(llama_dir, llm):
    prompt = [11, 12, 13, 14, 15]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model(llama_dir)(torch.tensor([prompt + ids])).logits[0].log_softmax(-1)
    for j, (tok, entry) in enumerate(zip(ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry[tok] - row[tok].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]] - ref[j - 1, prompt[j]].item()) < 1e-4
    assert abs(out.outputs[0].cumulative_logprob - sum(e[t] for t, e in zip(ids, out.outputs[0].logprobs))) < 1e-4


def test_n_samples_share_the_prompt(llm):
    prompt = random_prompts(1, lo=40, hi=40, seed=7)[0]
    g = tokens(llm.generate([prompt], GREEDY, use_tqdm=False))[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [g] * 3
    sampled = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    assert [o.index for o in sampled.outputs] == [0, 1, 2, 3]
    assert_pool_free(llm)


def test_incremental_text_equals_full_decode_with_multibyte(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["Ünïcödé text: 東京"] * 6, SamplingParams(temperature=1.0, seed=9, max_tokens=24, n=2),
                        use_tqdm=False)
    for out in outs:
        for o in out.outputs:
            assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)


def test_stream_yields_growing_outputs_and_aborts_on_close(llm):
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    full = llm.generate(["stream me"], p, use_tqdm=False)[0].outputs[0]
    seen = [o.outputs[0].token_ids for o in llm.stream("stream me", p)]
    assert seen[-1] == full.token_ids and [len(s) for s in seen] == list(range(1, 11))
    gen = llm.stream("stream me", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    next(gen), next(gen)
    gen.close()
    assert_pool_free(llm)


def test_chat_uses_the_tokenizer_template(llm):
    messages = [{"role": "user", "content": "hello there"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)


def test_max_model_len_and_eos(llama_dir, tiny_dir):
    llm = make_llm(llama_dir, max_model_len=40)
    out = llm.generate([list(range(2, 32))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    # eos ends a request unless ignore_eos: the same weights with the third greedy token declared eos
    ids = tokens(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False))[0]
    eos_llm = make_llm(tiny_dir("llama", eos_token_id=ids[2]), max_model_len=40)
    out = eos_llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:ids.index(ids[2]) + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = eos_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids


def test_metrics_are_filled(llm):
    out = llm.generate(["metrics"], GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_a_fault_in_one_request_ends_only_that_request(llama_dir, monkeypatch):
    """A request whose sampling or detokenization raises ends with finish_reason "error" and the message; every
    other request in the same steps gets exactly the tokens it gets without the faulty one; no block leaks."""
    from leapdecode.engine.detokenizer import Detokenizer
    ps = random_prompts(6, seed=5)
    ref = tokens(make_llm(llama_dir).generate(ps, GREEDY, use_tqdm=False))
    add = Detokenizer.add

    def faulty_add(self, token):
        if getattr(self, "faulty", False):
            raise UnicodeError("detokenizer exploded")
        return add(self, token)

    fail_sampling_of(monkeypatch, "bad-sampling")
    monkeypatch.setattr(Detokenizer, "add", faulty_add)
    llm = make_llm(llama_dir)
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    eng.add_request("bad-sampling", ps[0], GREEDY)
    eng.add_request("bad-text", ps[1], GREEDY)
    eng.requests["bad-text"].detoks[eng.requests["bad-text"].seqs[0].seq_id].faulty = True
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert [done[str(i)].token_ids for i in range(len(ps))] == ref
    assert done["bad-sampling"].finish_reason == "error" and "sampler exploded" in done["bad-sampling"].stop_reason
    assert done["bad-text"].finish_reason == "error" and "detokenizer exploded" in done["bad-text"].stop_reason
    assert_pool_free(llm)


def test_an_engine_nobody_holds_is_freed_and_close_releases_it(llama_dir):
    """Deleting an LLM frees its engine, weights and KV pool at once (the engine's start-up objects are frozen out
    of the garbage collector, so only reference counting can free them: the engine must hold no reference cycle);
    an engine still held on its own keeps working; ``close()`` releases the weights and the pool explicitly."""
    import gc
    import weakref
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = make_llm(llama_dir, speculative_config={"method": "suffix", "num_speculative_tokens": 3})
    llm.generate(["a b c"], params, use_tqdm=False)
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
    del llm
    assert engine() is None and pool() is None
    held = make_llm(llama_dir).engine                 # the LLM is gone at once; its engine is still in use
    held.add_request("r", "a b c", params)
    while held.has_unfinished():
        held.step()
    pool = weakref.ref(held.runner.kv_cache)
    del held
    assert pool() is None
    llm = make_llm(llama_dir)
    pool = weakref.ref(llm.engine.runner.kv_cache)
    llm.close()
    gc.collect()
    assert pool() is None and llm.engine.runner.model is None


@pytest.mark.parametrize("invariant", [True, None])
def test_batch_invariant_logprobs_are_bit_identical_alone_batched_and_drafted(tiny_dir, invariant):
    """Exact attention (``batch_invariant=True``, and the CPU default ``None``, whose decode and verification rows
    go through attention/cpu_exact.py's kernel): every request's log-probabilities are bit for bit the same alone,
    in a batch with requests of other lengths, and while verifying (partly wrong) drafts. Float32 SDPA gives them
    different last bits (tests/test_step.py shows why); on this model its tokens still agree."""
    from leapdecode.attention import cpu_exact
    if invariant is None and cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py: the default then keeps SDPA")
    from conftest import OracleDrafter
    path = tiny_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(6, lo=100, hi=300, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run(batched, spec=None):
        llm = make_llm(path, batch_invariant=invariant, max_model_len=512, speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False) if batched else \
            [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        if spec is not None:
            assert llm.engine.stats["accepted_tokens"] > 0
        assert llm.engine.runner.backend.exact == ("always" if invariant else "kernel")
        llm.close()
        return token_logprobs(outs)

    alone = run(False)
    assert run(True) == alone
    truth = {tuple(p): [[t for t, _ in a]] for p, a in zip(prompts, alone)}
    drafter = OracleDrafter(truth, wrong_every=3)
    assert run(True, {"drafter": drafter, "num_speculative_tokens": 4, "adaptive": False}) == alone


@pytest.mark.parametrize("invariant", [True, None])
def test_exact_logprobs_do_not_depend_on_prompt_chunks_or_the_prefix_cache(tiny_dir, invariant):
    """Exact attention reads prompt chunks of any length with the kernel too, so a request's log-probabilities are
    bit for bit the same whether its prompt ran as one long chunk, as many short ones, or mostly from the prefix
    cache (its tail then runs alone). With long chunks through SDPA (float32, or float64 under
    ``batch_invariant=True``) the cached run's last bits differed, and under int8 activations its tokens too."""
    from leapdecode.attention import cpu_exact
    if cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py: long chunks then run SDPA")
    path = tiny_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(4, lo=150, hi=300, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    def run(**kw):
        llm = make_llm(path, batch_invariant=invariant, max_model_len=512, **kw)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        again = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]   # hits if caching is on
        hits = llm.engine.block_manager.hits
        llm.close()
        return token_logprobs(outs), token_logprobs(again), hits

    whole, whole_again, _ = run(enable_prefix_caching=False)            # each prompt one chunk
    assert whole_again == whole
    chunked, _, _ = run(enable_prefix_caching=False, max_num_batched_tokens=40)
    assert chunked == whole
    cold, cached, hits = run(enable_prefix_caching=True)
    assert hits >= len(prompts) * 128                                   # most of every prompt from the cache
    assert cold == whole and cached == whole


def test_batch_invariant_bad_values_are_clear_errors(llama_dir):
    from leapdecode.attention.backend import get_backend
    from leapdecode.config import EngineConfig
    with pytest.raises(ValueError, match="batch_invariant must be True, False or None"):
        EngineConfig(model=llama_dir, batch_invariant="yes")
    with pytest.raises(ValueError, match="runs on the torch attention backend only"):
        get_backend("triton", torch.device("cpu"), exact="always")
    assert get_backend("auto", torch.device("cuda"), exact="always").name == "torch"
    assert get_backend("auto", torch.device("cuda"), exact="kernel").name == "triton"
    assert EngineConfig(model=llama_dir, quantization="int4").exact_attention == "always"
    assert EngineConfig(model=llama_dir, quantization="int4", batch_invariant=False).exact_attention == "off"
    assert EngineConfig(model=llama_dir).exact_attention == "kernel"
    assert EngineConfig(model=llama_dir, batch_invariant=True).exact_attention == "always"
