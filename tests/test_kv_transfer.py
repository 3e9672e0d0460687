"""KV transfer between engines (prefill/decode disaggregation, engine/kv_transfer.py): blocks exported by one engine
and imported by a fresh one are a prefix-cache hit there, giving the tokens of an engine that computed everything
itself; the pool's bookkeeping stays whole (duplicates skipped, a short pool installs a prefix, a failed import
leaves nothing behind); quantized blocks read back bit-identically; the payload pickles; mismatched layouts and
tensor parallelism are clear errors."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from conftest import CORPUS, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.engine.block_manager import BlockManager, chain_keys
from leapdecode.engine.kv_transfer import KVTransfer
from leapdecode.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt_(n: int, seed: int) -> list[int]:
    return torch.randint(5, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(llm, prompt) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def moved(transfer: KVTransfer) -> KVTransfer:
    """A transfer as it travels: through pickle."""
    return pickle.loads(pickle.dumps(transfer))


@pytest.fixture(scope="module")
def source(llama_dir):
    """The prefill engine after it ran a 40-token prompt (two full blocks and a partial one), with its export."""
    a = make_llm(llama_dir)
    prompt = prompt_(40, seed=1)
    out = greedy(a, prompt)
    return a, prompt, out, a.export_kv(prompt)


def test_import_is_a_prefix_cache_hit(llama_dir, source):
    a, prompt, want, t = source
    assert (t.num_blocks, t.num_tokens, t.token_ids) == (2, 32, tuple(prompt[:32]))
    assert t.nbytes == 2 * (2 * 2 * 16 * 2 * 16 * 4)           # 2 blocks of float32 K and V, 2 layers, 2 heads x 16
    b, c = make_llm(llama_dir), make_llm(llama_dir)
    assert b.import_kv(moved(t)) == 32
    assert greedy(b, prompt) == want == greedy(c, prompt)
    assert b.engine.block_manager.hits == 32 and c.engine.block_manager.hits == 0
    for llm in (b, c):
        assert_pool_free(llm)


def test_text_prompt_is_tokenized_like_generate(llama_dir):
    text = " ".join(CORPUS[:4])
    a, b = make_llm(llama_dir), make_llm(llama_dir)
    ids = a.get_tokenizer().encode(text)
    assert len(ids) >= 32
    want = a.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    t = a.export_kv(text)
    assert t.num_tokens == len(ids) // 16 * 16 and t.token_ids == tuple(ids[:t.num_tokens])
    assert b.import_kv(t) == t.num_tokens
    assert b.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    assert b.engine.block_manager.hits == min(t.num_tokens, (len(ids) - 1) // 16 * 16)


def test_block_aligned_prompt(llama_dir):
    """A prompt of exactly two blocks exports both; the request adopts one (match_prefix leaves the last token to
    compute, so the last block is computed again, not duplicated in the cache); a longer prompt adopts both."""
    prompt, longer = prompt_(32, seed=2), prompt_(32, seed=2) + prompt_(9, seed=3)
    a, b, c = make_llm(llama_dir), make_llm(llama_dir), make_llm(llama_dir)
    want = greedy(a, prompt)
    t = a.export_kv(prompt)
    assert b.import_kv(t) == 32
    assert greedy(b, prompt) == want == greedy(c, prompt)
    bm = b.engine.block_manager
    assert bm.hits == 16 and len(bm.cached) == 2              # its own copy of block 1 is not keyed twice
    assert greedy(b, longer) == greedy(c, longer)
    assert bm.hits == 16 + 32
    assert_pool_free(b)


def test_known_blocks_are_skipped_and_reimport_changes_nothing(llama_dir):
    """Blocks the importer caches already are kept (a transfer whose copies of them are garbage changes no token),
    only the missing ones are written, and importing again changes no bookkeeping."""
    prompt = prompt_(70, seed=4)                              # four full blocks
    a, b, c = make_llm(llama_dir), make_llm(llama_dir), make_llm(llama_dir)
    greedy(a, prompt)
    greedy(b, prompt[:33])                                    # b computed the first two blocks itself
    t = a.export_kv(prompt)
    assert t.num_blocks == 4
    garbage = tuple(tuple(torch.full_like(p, 7.0) for p in block) for block in t.blocks[:2])
    t = dataclasses.replace(t, blocks=garbage + t.blocks[2:])
    bm = b.engine.block_manager
    own = bm.cached_blocks(prompt)
    assert len(own) == 2
    assert b.import_kv(t) == 64
    assert bm.cached_blocks(prompt)[:2] == own and len(bm.cached_blocks(prompt)) == 4
    before = (dict(bm.cached), list(bm.block_keys), list(bm.ref_counts), set(bm.free))
    assert b.import_kv(t) == 64
    assert (dict(bm.cached), list(bm.block_keys), list(bm.ref_counts), set(bm.free)) == before
    hits = bm.hits
    assert greedy(b, prompt) == greedy(c, prompt)
    assert bm.hits - hits == 64
    assert_pool_free(b)


def test_import_waits_for_the_step_in_flight(llama_dir, source, monkeypatch):
    """With async_scheduling, generate returns while one more step runs (a finished sequence's wasted row, writing
    KV into a block the last update freed). An import that reuses that block must land after that write."""
    import threading
    import time
    _, prompt, want, t = source
    b = make_llm(llama_dir, async_scheduling=True)
    execute = b.engine.runner.execute

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)                                   # the worker's forward comes late
        return execute(*args, **kwargs)
    monkeypatch.setattr(b.engine.runner, "execute", slow)
    other = prompt_(20, seed=8)
    first = greedy(b, other)[0]
    b.generate([other], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[first]), use_tqdm=False)
    assert b.engine._inflight is not None                     # the wasted row's step is still running
    assert b.import_kv(t) == 32
    assert greedy(b, prompt) == want                          # (one stale slot need not change a token)
    back = b.engine.runner.read_kv_blocks(b.engine.block_manager.cached_blocks(prompt))
    assert all(torch.equal(x, y) for got, sent in zip(back, t.blocks) for x, y in zip(got, sent))


def test_install_never_evicts_its_own_chain():
    """The pool's only free blocks outside the chain are used up: install stops there (a prefix of the chain), and
    leaves the chain at the most-recently-used end, its head last."""
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    tokens = list(range(100, 124))                            # six blocks of four
    keys = chain_keys(tokens, 4)
    assert bm.install(keys[:2]) == [0, 1]
    assert list(bm.free) == [2, 3, 1, 0]
    assert bm.install(keys) == [-1, -1, 2, 3]                 # 0 and 1 kept, never popped to make room
    assert bm.cached_blocks(tokens) == [0, 1, 2, 3] and list(bm.free) == [3, 2, 1, 0]
    assert bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4
    seq = Sequence("r", 0, tokens[:17], SamplingParams(max_tokens=1))
    assert bm.match_prefix(seq) == 16 and seq.block_table == [0, 1, 2, 3]
    off = BlockManager(4, 4, enable_prefix_caching=False)
    assert off.install(keys) == [] and not off.cached


def test_short_pool_installs_a_prefix(llama_dir):
    a = make_llm(llama_dir)
    prompt = prompt_(90, seed=5)
    greedy(a, prompt)
    t = a.export_kv(prompt)
    assert t.num_blocks == 5
    small = dict(num_kv_blocks=4, max_model_len=64)
    b, c = make_llm(llama_dir, **small), make_llm(llama_dir, **small)
    assert b.import_kv(t) == 64                               # the whole pool, the chain's first four blocks
    assert greedy(b, prompt[:50]) == greedy(c, prompt[:50])
    assert b.engine.block_manager.hits == 48
    assert_pool_free(b)
    # blocks held by a running request are not free: only the rest takes the chain
    b = make_llm(llama_dir, num_kv_blocks=5, max_model_len=64)
    b.engine.add_request("busy", prompt_(40, seed=6), GREEDY)
    b.engine.step()                                           # the request holds three blocks until it ends
    assert b.import_kv(t) == 32
    while b.engine.has_unfinished():
        b.engine.step()
    assert greedy(b, prompt[:40]) == greedy(c, prompt[:40])
    assert b.engine.block_manager.hits == 32
    assert_pool_free(b)


def test_layout_mismatch_is_refused(tiny_dir, llama_dir, source):
    _, _, _, t = source
    cases = [(make_llm(llama_dir, block_size=8), r"block_size=16 \(this engine: 8\)"),
             (make_llm(llama_dir, kv_cache_dtype="int8"), r"kv_cache_dtype='auto' \(this engine: 'int8'\)"),
             (make_llm(llama_dir, dtype="bfloat16"), r"dtype='float32' \(this engine: 'bfloat16'\)"),
             (make_llm(tiny_dir("llama", num_hidden_layers=3)), r"num_layers=2 \(this engine: 3\)"),
             (make_llm(tiny_dir("llama", num_key_value_heads=1)), r"num_kv_heads=2 \(this engine: 1\)")]
    for llm, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.import_kv(t)
        assert not llm.engine.block_manager.cached
        assert_pool_free(llm)


def test_malformed_payload_leaves_nothing_behind(llama_dir, source):
    _, prompt, want, t = source
    b = make_llm(llama_dir)
    with pytest.raises(ValueError, match="32 token ids for 1 blocks"):
        b.import_kv(dataclasses.replace(t, blocks=t.blocks[:1]))
    cut = tuple((block[0][..., :-1].contiguous(),) for block in t.blocks)
    with pytest.raises(ValueError, match="data is"):
        b.import_kv(dataclasses.replace(t, blocks=cut))
    bm = b.engine.block_manager
    assert not bm.cached and all(k is None for k in bm.block_keys)   # the keys installed for it were taken back
    assert b.import_kv(t) == 32 and greedy(b, prompt) == want
    assert_pool_free(b)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_quantized_blocks_read_back_bit_identically(llama_dir, fmt):
    """Every plane of a quantized block (codes, scales or grids, int4's salient tokens) travels: the importer reads
    back exactly the exported bytes, and its tokens are the exporter's own prefix-cache hit's."""
    prompt = prompt_(40, seed=7)
    a, b = make_llm(llama_dir, kv_cache_dtype=fmt), make_llm(llama_dir, kv_cache_dtype=fmt)
    greedy(a, prompt)
    t = moved(a.export_kv(prompt))
    assert t.num_blocks == 2 and len(t.blocks[0]) == {"fp8": 2, "int8": 5, "int4": 5}[fmt]
    assert b.import_kv(t) == 32
    back = b.engine.runner.read_kv_blocks(b.engine.block_manager.cached_blocks(prompt))
    assert len(back) == 2
    for got, sent in zip(back, t.blocks):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, sent))
    if fmt == "int4":
        assert t.blocks[0][4].numel() > 0                     # salient tokens' low nibbles are part of it
    hit = greedy(a, prompt)                                   # the exporter's own prefix-cache hit
    assert greedy(b, prompt) == hit
    assert b.engine.block_manager.hits == a.engine.block_manager.hits == 32
    for llm in (a, b):
        assert_pool_free(llm)
        assert len(llm.engine.block_manager.free_window) == llm.engine.block_manager.num_window_blocks


def test_payload_pickles_alone(source):
    """A block owns its storage: the pickle carries the blocks' bytes, not the pool they were read from."""
    _, _, _, t = source
    back = pickle.loads(pickle.dumps(t))
    assert back.layout == t.layout and back.token_ids == t.token_ids and back.num_blocks == t.num_blocks
    assert all(torch.equal(x, y) for bx, by in zip(back.blocks, t.blocks) for x, y in zip(bx, by))
    assert all(x.is_contiguous() and x.device.type == "cpu" for block in t.blocks for x in block)
    assert len(pickle.dumps(t)) < t.nbytes + 8192


def test_nothing_cached_nothing_moved(llama_dir, source):
    """An engine that never saw the prompt exports an empty transfer; an engine without prefix caching caches
    nothing (and still generates the right tokens)."""
    _, prompt, want, t = source
    fresh = make_llm(llama_dir)
    empty = fresh.export_kv(prompt)
    assert (empty.num_blocks, empty.num_tokens, empty.nbytes) == (0, 0, 0)
    assert fresh.import_kv(empty) == 0
    off = make_llm(llama_dir, enable_prefix_caching=False)
    assert off.import_kv(t) == 0 and not off.engine.block_manager.cached
    assert greedy(off, prompt) == want
    assert_pool_free(off)


def test_tensor_parallel_executor_refuses():
    from leapdecode.engine.tp_executor import TensorParallelExecutor
    tp = TensorParallelExecutor.__new__(TensorParallelExecutor)           # no worker processes needed
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1"):
        tp.read_kv_blocks([0])
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1"):
        tp.write_kv_blocks([0], [()])
