"""The step's seams: plans and results are plain data, the overlapped step changes no token, the model runs layer
ranges and returns hidden states like transformers, capacity-bucket padding changes nothing, and the KV pool is
not touched at start-up."""
import pickle
import random

import pytest
import torch

from conftest import assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.attention.kv_cache import KVCache
from leapdecode.engine.step import ScheduledSeq, lay_out
from leapdecode.spec.tree import EMPTY, DraftTree


def cpu_meta(bs, seqs):
    """The attention metadata of a CPU step scheduling ``seqs`` (block size ``bs``), as the runner builds it."""
    from leapdecode.engine.input_batch import InputBuffers
    return InputBuffers(torch.device("cpu")).build(lay_out(0, bs, seqs), None).meta


def prompts(n, seed=0, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(2, 50))] for _ in range(n)]


def test_plan_and_result_are_plain_data_that_another_executor_can_run(llama_dir):
    a, b = make_llm(llama_dir), make_llm(llama_dir)
    eng = a.engine
    for i, p in enumerate(prompts(3)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    plans = []
    while eng.has_unfinished():
        plan = eng.scheduler.schedule()
        copy = pickle.loads(pickle.dumps(plan))
        assert copy == plan
        mine = eng.runner.execute(plan).logits
        theirs = b.engine.runner.execute(copy).logits          # a second executor, fed only the unpickled plan
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        result, _ = eng.verifier.verify(plan, mine, eng.verifier.batch(plan, eng.seqs), None, eng.seqs)
        assert pickle.loads(pickle.dumps(result)) == result
        eng._commit(plan, result, 0.0)
        plans.append(plan)
    assert len(plans) == 4 and all(len(p.seqs) == 3 for p in plans)
    assert_pool_free(a)


def test_tree_plan_carries_positions_and_masks_into_the_forward(llama_dir):
    """A chunk that ends in a tree: each node's logits equal those of its own root path run as a chain."""
    llm = make_llm(llama_dir)
    eng = llm.engine
    ctx = [5, 6, 7, 8, 9]
    tree = DraftTree.of([20, 30, 21, 31, 40], [-1, -1, 0, 1, 2])
    blocks = tuple(range(4))

    def run(tokens, draft):
        chunk = ScheduledSeq(0, 0, tuple(tokens) + draft.tokens, blocks, draft, samples=True)
        return eng.runner.execute(lay_out(0, 16, [chunk])).logits

    tree_logits = run(ctx, tree)
    for node, path in enumerate(tree.node_paths()):
        chain = run(ctx, DraftTree.of(path))
        torch.testing.assert_close(tree_logits[1 + node], chain[-1], rtol=1e-5, atol=1e-5)


WORKLOAD = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=14, n=2, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=20, stop=["a"], prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=1),
]


@pytest.mark.parametrize("unsafe", [False, True])
def test_overlapped_step_is_token_for_token_the_synchronous_one(llama_dir, unsafe):
    """Mixed lengths, seeds, n > 1, stop strings, logprobs and prompt logprobs; with ``unsafe`` some requests
    need host tokens (penalties), so the engine drains and alternates between the two kinds of step."""
    ps = prompts(15, seed=4)
    params = [WORKLOAD[i % len(WORKLOAD)] for i in range(len(ps))]
    if unsafe:
        params[4] = SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=1.3)
    outs, lps = {}, {}
    for overlap in (False, True):
        llm = make_llm(llama_dir, async_scheduling=overlap, max_num_batched_tokens=64, seed=9)
        got = llm.generate(ps, params, use_tqdm=False)
        outs[overlap] = [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] for r in got]
        lps[overlap] = [[o.logprobs for o in r.outputs] + [r.prompt_logprobs] for r in got]
        if overlap:
            assert llm.engine.stats["overlapped_steps"] > 0
        assert_pool_free(llm)
    assert outs[True] == outs[False]
    # logprobs agree to float rounding (a step's batch may hold one more row when overlapped: other GEMM shapes)
    assert str(lps[True]).count(":") == str(lps[False]).count(":")
    for a, b in zip(flat(lps[True]), flat(lps[False])):
        assert a == b if not isinstance(a, float) else abs(a - b) < 1e-4


def flat(x):
    if isinstance(x, dict):
        for k in sorted(x):
            yield k
            yield x[k]
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from flat(y)
    else:
        yield x


def test_overlapped_stream_and_abort_leave_nothing_behind(llama_dir):
    llm = make_llm(llama_dir, async_scheduling=True)
    ref = make_llm(llama_dir).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    seen = []
    for i, out in enumerate(llm.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=30))):
        seen = out.outputs[0].token_ids
        if i == 5:
            break                                       # closing the stream aborts with a step in flight
    assert seen == ref[0].outputs[0].token_ids[:len(seen)]
    llm.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)   # drains the aborted step's result
    assert_pool_free(llm)


def test_hidden_states_and_layer_ranges_match_transformers(llama_dir):
    import transformers
    llm = make_llm(llama_dir)
    eng = llm.engine
    tokens = [5, 17, 90, 3, 44, 250, 8]
    chunk = ScheduledSeq(0, 0, tuple(tokens), (0,), prompt_logprobs=True)
    plan = lay_out(0, 16, [chunk])
    L = eng.model_cfg.num_layers
    out = eng.runner.execute(plan, capture=tuple(range(L + 1)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True)
    for i in range(L + 1):
        torch.testing.assert_close(out.hidden_states[i], ref.hidden_states[i][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    # the same forward as two ranges: layers [0, 1) then [1, L) from the captured stream
    batch = eng.runner.prepare(plan)
    model = eng.runner.model
    with torch.inference_mode():
        eng.runner.backend.plan(batch.meta)
        mid = model(batch.input_ids, batch.meta, end_layer=1)
        final = model(batch.input_ids, batch.meta, start_layer=1, hidden=mid)
        logits = model.compute_logits(final)
    torch.testing.assert_close(mid, out.hidden_states[1], rtol=0, atol=0)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)


def test_padding_to_capacity_buckets_changes_nothing(llama_dir):
    ps = prompts(5, seed=2)
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = make_llm(llama_dir, pad_to_buckets=False).generate(ps, p, use_tqdm=False)
    padded_llm = make_llm(llama_dir, pad_to_buckets=True)
    plan = padded_llm.engine.scheduler.schedule()
    assert not plan                                    # nothing queued yet: an empty plan
    padded = padded_llm.generate(ps, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in padded] == [o.outputs[0].token_ids for o in plain]
    assert_pool_free(padded_llm)


def test_the_kv_pool_is_not_touched_at_start_up():
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    before = rss()
    cache = KVCache(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=8, head_dim=64,
                    dtype=torch.bfloat16, device=torch.device("cpu"))      # 512 MiB
    grown = rss() - before
    assert cache.data.numel() * 2 == 512 << 20
    assert grown < 64 << 20, grown
    assert float(cache.data[3, 1, 4095].abs().sum()) == 0.0             # reads as zeros


def test_torch_attention_pads_decodes_apart_from_verification_rows():
    """A speculating step mixes plain decodes with multi-token verification rows; the torch backend attends the
    decodes in their own one-query batch (no padding to the verification's length, which doubled SDPA's cost at
    batch 16), and the step's logits are still transformers' (covered by the engine tests)."""
    from leapdecode.attention.torch_ref import TorchAttention
    from leapdecode.engine.input_batch import InputBuffers
    seqs = [ScheduledSeq(0, 20, (5,), (0, 1), samples=True),
            ScheduledSeq(1, 33, (6,), (2, 3, 4), samples=True),
            ScheduledSeq(2, 10, (7, 8, 9, 10, 11), (5,), draft=DraftTree.of([9, 10, 11], None), samples=True)]
    plan = lay_out(0, 16, seqs)
    meta = InputBuffers(torch.device("cpu")).build(plan, None).meta
    TorchAttention().plan(meta)
    decode, verify = meta.plan
    assert decode.valid_q is None and decode.q_index.shape == (2, 1)       # the two decodes, one query each
    assert verify.valid_q is not None and verify.q_index.shape == (1, 5)   # the verification row alone


@pytest.mark.parametrize("drafted,tree", [(0, False), (3, False), (3, True)])
def test_torch_attention_groups_rows_by_context_length(drafted, tree):
    """Attention reads every gathered key, padding included: 8 short and 8 long decodes (or verifications of a
    3-token draft) are two padded batches (each to its own longest context), not one padded to 1,000 keys, and
    every sequence's output equals the sequence attended alone. (Verification rows in one batch: at batch 64 on
    the CPU, 64 one-token drafts over 50-1,000-token contexts cost 1,334 ms a step, grouped 940 ms, plain 842.)
    With token trees and contexts of one group, not in the step's order: each tree's mask on its own rows (a
    group holding every sequence was taken to be in the step's order, and the masks went to the wrong rows)."""
    from leapdecode.attention.torch_ref import TorchAttention
    bs, hkv, d, group = 16, 2, 8, 2
    lens = [12, 20, 9, 30, 17, 25, 11, 14] + ([] if tree else [900, 1000, 950, 980, 910, 990, 1000, 930])
    q_len = 1 + drafted
    seqs, block = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        parents = [-1, -1, i % 2] if tree else None      # two shapes of tree
        draft = DraftTree.of(tuple(range(6, 6 + drafted)), parents) if drafted else EMPTY
        seqs.append(ScheduledSeq(i, n - q_len, tuple(range(5, 5 + q_len)), tuple(range(block, block + nb)),
                                 draft, samples=True))
        block += nb
    meta = cpu_meta(bs, seqs)
    backend = TorchAttention()
    backend.plan(meta)
    assert sorted(g.max_k for g in meta.plan) == ([30] if tree else [30, 1000])
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, block, bs, hkv, d, generator=gen)
    q = torch.randn(len(lens) * q_len, hkv * group, d, generator=gen)
    out = backend.attend(q, cache, meta, 0.3)
    for i in (0, 3, 6 if tree else 9):       # a sequence attended alone: same result
        alone = cpu_meta(bs, [seqs[i]])
        rows = slice(i * q_len, (i + 1) * q_len)
        torch.testing.assert_close(backend.attend(q[rows], cache, alone, 0.3), out[rows], rtol=0, atol=1e-6)


def test_a_speculator_the_guard_switched_off_runs_overlapped_then_drafts_again(llama_dir):
    """With ``async_scheduling``, a speculating engine whose guard has the drafter off (a veto) runs overlapped
    steps as plain decoding does: the guard's clock still counts them, so the veto ends and drafting resumes; their
    step-to-step times are the guard's bare rate. Tokens equal plain decoding's, nothing leaks."""
    ps = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(ps, params, use_tqdm=False)]
    llm = make_llm(llama_dir, async_scheduling=True, speculative_config={"method": "ngram",
                                                                        "num_speculative_tokens": 3})
    guard = llm.engine.speculator.guard
    guard.veto_until = 20                     # vetoed for the first 20 decode steps
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert got == plain
    stats = llm.engine.stats
    assert stats["overlapped_steps"] >= 15, stats
    assert guard.steps >= 20 and llm.engine.speculator.num_proposals + llm.engine.speculator.num_shadow_proposals > 0
    bare = [b.rates["bare"] for b in guard._batches.values()]
    assert sum(r.count for r in bare) >= 15           # the overlapped steps' times are bare samples
    assert_pool_free(llm)


def test_final_only_requests_give_one_output_with_the_streamed_text(llama_dir):
    """``stream=False`` (how LLM.generate adds requests): one RequestOutput per request, when it finishes, with
    exactly the text and tokens a streamed request ends with (deferred detokenization; stop strings still cut)."""
    ps = prompts(6, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=24, stop=["a", "e"])]
    finals = {}
    for stream in (True, False):
        llm = make_llm(llama_dir, seed=2)
        for i, p in enumerate(ps):
            llm.engine.add_request(str(i), p, params[i % len(params)], stream=stream)
        seen: dict[str, int] = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                seen[out.request_id] = seen.get(out.request_id, 0) + 1
                if out.finished:
                    finals[(stream, out.request_id)] = [(o.text, o.token_ids, o.finish_reason, o.stop_reason)
                                                        for o in out.outputs]
        if not stream:
            assert set(seen.values()) == {1}, seen
        else:
            assert max(seen.values()) > 1
        assert_pool_free(llm)
    for i in range(len(ps)):
        assert finals[(True, str(i))] == finals[(False, str(i))]
    assert any(r[2] == "stop" and isinstance(r[3], str) for i in range(len(ps)) for r in finals[(False, str(i))])


@pytest.mark.parametrize("path,d", [("kernel", 64), ("kernel", 36), ("float64", 64)])
def test_exact_torch_attention_gives_a_row_the_same_bits_in_any_step(path, d, monkeypatch):
    """``TorchAttention(exact="always")`` (used under ``quantization="int4"``, whose bfloat16 activations turn a
    last-bit difference into a different token): a query row's output is bit for bit the same whether it is a
    plain decode alone, a plain decode padded beside a longer partner, or one row of a 5-token verification
    (float32 SDPA gives each of these different last bits); through the C++ kernel and through its float64
    fallback; the kernel at a head size it specializes (64) and at one with a partial vector of lanes (36)."""
    from leapdecode.attention import cpu_exact
    from leapdecode.attention.torch_ref import TorchAttention
    if path == "kernel" and cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py")
    if path == "float64":
        monkeypatch.setattr(cpu_exact, "kernel", lambda: None)
    bs, hkv, group, n = 16, 3, 3, 600
    nb = -(-(n + 5) // bs)
    own, partner = tuple(range(nb)), tuple(range(nb, nb + 64))
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, nb + 64, bs, hkv, d, generator=gen)
    q = torch.randn(5, hkv * group, d, generator=gen)
    backend = TorchAttention(exact="always")

    def attend(seqs, rows):
        return backend.attend(rows, cache, cpu_meta(bs, seqs), 0.125)

    verify = attend([ScheduledSeq(0, n, (5, 6, 7, 8, 9), own, DraftTree.of((6, 7, 8, 9), None), samples=True)], q)
    for i in range(5):
        alone = attend([ScheduledSeq(0, n + i, (5,), own, samples=True)], q[i:i + 1])
        padded = attend([ScheduledSeq(0, n + i, (5,), own, samples=True),
                         ScheduledSeq(1, 1000, (5,), partner, samples=True)], torch.cat([q[i:i + 1], q[:1]]))
        assert torch.equal(alone, verify[i:i + 1]) and torch.equal(padded[:1], alone), i


@pytest.mark.parametrize("exact,context,length", [("always", 100, 300), ("kernel", 0, 700), ("kernel", 37, 45)])
def test_exact_attention_gives_a_long_prompt_chunk_its_rows_bits_alone(exact, context, length):
    """Exact attention reads prompt chunks of any length with the kernel (row slabs above 32 rows), so each row of
    a long chunk gets the bits it gets as a decode alone: a prompt's keys and values, and its first token, do not
    depend on how it was chunked or how much of it came from the prefix cache. (Through SDPA, float32 or float64,
    long chunks got other last bits.)"""
    from leapdecode.attention import cpu_exact
    from leapdecode.attention.torch_ref import TorchAttention
    if cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py")
    bs, hkv, group, d = 16, 3, 3, 64
    nb = -(-(context + length) // bs)
    own = tuple(reversed(range(nb)))
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen)
    q = torch.randn(length, hkv * group, d, generator=gen)
    backend = TorchAttention(exact=exact)

    def attend(seq, rows):
        return backend.attend(rows, cache, cpu_meta(bs, [seq]), 0.125)

    chunk = attend(ScheduledSeq(0, context, tuple([5] * length), own, samples=True), q)
    for i in sorted({0, 1, 31, 32, 33, length // 2, length - 2, length - 1}):
        alone = attend(ScheduledSeq(0, context + i, (5,), own, samples=True), q[i:i + 1])
        assert torch.equal(alone, chunk[i:i + 1]), i


@pytest.mark.parametrize("dtype,d", [(torch.float32, 40), (torch.bfloat16, 40), (torch.float32, 36),
                                     (torch.float32, 64), (torch.bfloat16, 128)])
def test_exact_kernel_matches_float64_attention(dtype, d):
    """attention/cpu_exact.py's kernel against SDPA in float64 on the same paged cache: decodes and token-tree
    verifications in one step, grouped query attention, the head sizes it specializes (64, 128), others, and one
    with a partial vector of lanes (36). Cache slots no row sees hold NaN (a pool's unwritten memory): they must
    not reach the output."""
    from leapdecode.attention import cpu_exact
    from leapdecode.attention.torch_ref import TorchAttention
    if cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py")
    bs, hkv, group = 16, 2, 3
    lens = [37, 70, 5, 129]
    seqs, block = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        draft = DraftTree.of((6, 7, 8), [-1, -1, 0]) if i % 2 else EMPTY
        q_len = 1 + len(draft.tokens)
        seqs.append(ScheduledSeq(i, n - q_len, tuple(range(5, 5 + q_len)), tuple(range(block, block + nb)), draft,
                                 samples=True))
        block += nb
    meta = cpu_meta(bs, seqs)
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, block, bs, hkv, d, generator=gen).to(dtype)
    q = torch.randn(sum(1 + (3 if i % 2 else 0) for i in range(len(lens))), hkv * group, d, generator=gen)
    ours = TorchAttention(exact="always").attend(q, cache, meta, 0.2)
    meta.plan = None
    ref = TorchAttention().attend(q.double(), cache.double(), meta, 0.2)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=2e-6, atol=2e-6)
    unseen = cache.clone()
    block = 0
    for n in lens:                  # the slots after each sequence's last token, in its last block
        nb = -(-n // bs)
        unseen[:, block + nb - 1, n - (nb - 1) * bs:] = float("nan")
        block += nb
    meta.plan = None
    assert torch.equal(TorchAttention(exact="always").attend(q, unseen, meta, 0.2), ours)


def test_async_engine_runs_every_forward_on_one_thread(llama_dir):
    """With async_scheduling the overlapped steps run on the worker, and the synchronous ones (an unsafe request:
    a penalty) too: one thread runs the model. A second one, with OpenMP workers of its own, made every later step
    ~2.6x slower on the CPU (leapdecode/native.py, release_openmp_threads)."""
    import threading
    llm = make_llm(llama_dir, async_scheduling=True)
    eng = llm.engine
    threads, execute = set(), eng.runner.execute

    def traced(*args, **kwargs):
        threads.add(threading.get_ident())
        return execute(*args, **kwargs)

    eng.runner.execute = traced
    llm.generate(["a b c"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    overlapped = eng.stats["overlapped_steps"]
    llm.generate(["d e"], SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=0.5), use_tqdm=False)
    assert overlapped > 0 and eng.stats["overlapped_steps"] == overlapped      # both kinds of step ran
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_stepping_from_another_thread_is_said_once(llama_dir, caplog):
    """An engine stepped from a second thread logs one warning (on a CPU each thread running the model keeps an
    OpenMP pool of its own: leapdecode/native.py), and only once."""
    import logging
    from concurrent.futures import ThreadPoolExecutor
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: nothing to say")
    llm = make_llm(llama_dir)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="leapdecode.engine.engine"):
        llm.generate(["a b"], params, use_tqdm=False)
        assert not caplog.records
        with ThreadPoolExecutor(1) as pool:
            pool.submit(llm.generate, ["c d"], params, use_tqdm=False).result()
        llm.generate(["e f"], params, use_tqdm=False)
    warned = [r for r in caplog.records if "another thread" in r.getMessage()]
    assert len(warned) == 1
