"""Sparse long-context decoding (attention/sparse.py: per-layer top-k and TidalDecode): exact when the budget covers
the context, each selection rule against a reference written here, and the engine's guarantees with a small (lossy)
budget."""
import math
import random

import pytest
import torch

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams, SparseAttentionConfig, SpeculativeConfig
from leapdecode.attention import cpu_exact
from leapdecode.attention.backend import AttentionMetadata, get_backend
from leapdecode.attention.sparse import SparseAttention, SparseStep
from leapdecode.attention.torch_ref import TorchAttention

H, HKV, D, BS, LAYERS = 4, 2, 16, 8, 5
SCALE = D ** -0.5


# -- the attention backend on random data -------------------------------------------------------------------------

def paged_batch(lens: list[int], qlens: list[int], seed: int = 0):
    """A random paged cache of LAYERS layers with sequences of ``lens`` keys (the last ``qlens`` of them are this
    step's queries) in shuffled blocks, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(nblocks) + 3, generator=g).tolist()
    tables, o = [], 0
    for nb in nblocks:
        tables.append(perm[o:o + nb])
        o += nb
    width = max(nblocks)
    cache = torch.randn(LAYERS, 2, sum(nblocks) + 3, BS, HKV, D, generator=g)
    pos = [p for n, q in zip(lens, qlens) for p in range(n - q, n)]
    seq_of = [i for i, q in enumerate(qlens) for _ in range(q)]
    slots = [tables[i][p // BS] * BS + p % BS for i, p in zip(seq_of, pos)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]), seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor(qsl), query_lens=list(qlens), seq_lens_host=list(lens), block_size=BS,
        num_actual_tokens=len(pos))
    return cache, meta, tables


def sparse_backend(**cfg) -> TorchAttention:
    return TorchAttention(SparseAttention(SparseAttentionConfig(**cfg), LAYERS))


def context(cache_layer, table, n):
    """Sequence keys and values in position order: [n, Hkv, D] each."""
    k = torch.cat([cache_layer[0, b] for b in table])[:n]
    v = torch.cat([cache_layer[1, b] for b in table])[:n]
    return k.double(), v.double()


def ref_attention(q, k, v, keep=None):
    """q [H, D] over k, v [n, Hkv, D] (float64), restricted to the positions in ``keep`` when given."""
    idx = torch.tensor(sorted(keep)) if keep is not None else torch.arange(k.shape[0])
    out = []
    for h in range(H):
        g = h // (H // HKV)
        p = torch.softmax(k[idx, g] @ q[h].double() * SCALE, 0)
        out.append(p @ v[idx, g])
    return torch.stack(out)


def ref_selection(q, k, n_chosen, window):
    """The paper's rule, one set shared by the heads: the top ``n_chosen`` earlier positions by the attention
    probability summed over all query heads, plus the ``window`` most recent positions."""
    n = k.shape[0]
    score = sum(torch.softmax(k[:, h // (H // HKV)] @ q[h].double() * SCALE, 0) for h in range(H))
    return set(score[:n - window].topk(n_chosen).indices.tolist()) | set(range(n - window, n))


def run_layers(backend, cache, meta, seed=1):
    """Attend layer by layer as a model does (one plan, then every layer with its index); queries per layer."""
    g = torch.Generator().manual_seed(seed)
    backend.plan(meta)
    qs = [torch.randn(meta.num_actual_tokens, H, D, generator=g) for _ in range(LAYERS)]
    outs = [backend.attend(qs[layer], cache[layer], meta, SCALE, layer=layer) for layer in range(LAYERS)]
    return qs, outs


@pytest.mark.parametrize("budget", [1.0, 200, 0.99])
def test_budget_covering_the_context_equals_full_attention_exactly(budget):
    lens, qlens = [150, 90, 12, 60], [1, 1, 1, 5]          # decodes and a prefill chunk in one step
    cache, meta, _ = paged_batch(lens, qlens)
    _, full = run_layers(TorchAttention(), cache, meta)
    for cfg in ({"selection": "tidal", "selection_layers": (1, 3)}, {"dense_layers": 1}):
        _, sparse = run_layers(sparse_backend(budget=budget, window=4, **cfg), cache, meta)
        assert not any(isinstance(p, SparseStep) for p in meta.plan)
        assert all(torch.equal(a, b) for a, b in zip(full, sparse))
    assert not any(isinstance(p, SparseStep) for p in meta.plan)
    assert all(torch.equal(a, b) for a, b in zip(full, sparse))


def test_selection_and_sparse_layers_follow_the_papers_rule(monkeypatch):
    lens, qlens = [100, 70, 41, 6, 30], [1, 1, 1, 1, 4]   # three sparse decodes, a short decode, a prefill chunk
    budget, window, sel = 0.25, 4, (1, 3)
    cache, meta, tables = paged_batch(lens, qlens, seed=2)
    gathers = []
    monkeypatch.setattr(SparseStep, "_context",
                        lambda self, kv, values=True, _orig=SparseStep._context:
                        gathers.append(1) or _orig(self, kv, values))
    qs, outs = run_layers(sparse_backend(budget=budget, window=window, selection="tidal", selection_layers=sel),
                          cache, meta)
    (step,) = [p for p in meta.plan if isinstance(p, SparseStep)]
    assert step.rows == [0, 1, 2]
    # only the selection layers (and, without the CPU kernels, the full layer below them: the exact kernel reads it
    # in place) gather whole contexts; the sparse layers gather selected slots only
    assert len(gathers) == (2 if cpu_exact.kernel() is not None else 3)
    _, full = run_layers(TorchAttention(), cache, meta)
    for i in (3, 4):                           # rows that are not sparse: full attention (in a smaller padded batch)
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        for a, b in zip(outs, full):
            torch.testing.assert_close(a[rows], b[rows], rtol=1e-6, atol=1e-6)
    for b, i in enumerate(step.rows):
        n, row = lens[i], int(meta.query_start_loc[i])
        keep = None
        for layer in range(LAYERS):
            k_all, v_all = context(cache[layer], tables[i], n)
            q = qs[layer][row]
            if layer < sel[0]:
                ref = ref_attention(q, k_all, v_all)
            elif layer in sel:
                ref = ref_attention(q, k_all, v_all)
                keep = ref_selection(q, k_all, math.ceil(budget * n), window)
                if layer == sel[-1]:
                    got = step.positions[b][step.selected_valid[b]].tolist()
                    assert len(got) == len(set(got)) == math.ceil(budget * n) + window
                    assert set(got) == keep
            else:
                ref = ref_attention(q, k_all, v_all, keep)
            torch.testing.assert_close(outs[layer][row].double(), ref, rtol=1e-5, atol=1e-5)


def test_selecting_every_position_reproduces_full_attention():
    """The sparse gather through the block table is exact: with every position selected it is full attention."""
    lens = [64, 33]
    cache, meta, _ = paged_batch(lens, [1, 1], seed=3)
    backend = sparse_backend(budget=1, window=1, selection="tidal", selection_layers=(0,))
    backend.plan(meta)
    (step,) = [p for p in meta.plan if isinstance(p, SparseStep)]
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(5))
    step.num_chosen = max(lens) - 1                            # widen the selection to every position
    step.selected_valid = torch.cat([torch.arange(max(lens) - 1)[None] < torch.tensor(lens)[:, None] - 1,
                                     torch.ones(2, 1, dtype=torch.bool)], 1)
    dense = backend.attend(q, cache[0], meta, SCALE, layer=0)    # selection layer: full attention + selection
    sparse = backend.attend(q, cache[1], meta, SCALE, layer=1)
    plain = TorchAttention()
    plain.plan(meta)
    torch.testing.assert_close(sparse, plain.attend(q, cache[1], meta, SCALE), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, plain.attend(q, cache[0], meta, SCALE), rtol=1e-5, atol=1e-6)


def test_a_forward_that_skips_the_selection_layer_selects_at_its_first_sparse_layer():
    cache, meta, _ = paged_batch([80], [1], seed=4)
    backend = sparse_backend(budget=8, window=2, selection="tidal", selection_layers=(1,))
    backend.plan(meta)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(6))
    out = backend.attend(q, cache[3], meta, SCALE, layer=3)      # layer 1 skipped (layer-skip drafting)
    assert meta.plan[-1].positions is not None
    with pytest.raises(ValueError, match="layer index"):
        backend.attend(q, cache[3], meta, SCALE)
    plain = TorchAttention()
    plain.plan(meta)
    torch.testing.assert_close(out, plain.attend(q, cache[3], meta, SCALE), rtol=1e-5, atol=1e-6)


def ref_top_k(q, k, n_chosen, window):
    """per_layer's rule for one KV head's query group q [group, D] over k [n, D]: the top ``n_chosen`` earlier
    positions by the attention probability summed over the group, plus the ``window`` most recent positions."""
    n = k.shape[0]
    score = torch.softmax(q.double() @ k.T * SCALE, -1).sum(0)
    return set(score[:n - window].topk(n_chosen).indices.tolist()) | set(range(n - window, n))


def assert_heads_attend_exactly(outs, qs, cache, tables, meta, step, lens, dense, keep):
    """Each sparse row, layer by layer: full attention below ``dense``; above, each KV head's query group attends
    exactly over the positions ``keep(group queries [G, D], the head's keys [n, D], n)`` chooses."""
    group = H // HKV
    for i in step.rows:
        n, row = lens[i], int(meta.query_start_loc[i])
        for layer in range(LAYERS):
            k_all, v_all = context(cache[layer], tables[i], n)
            q = qs[layer][row].double()
            if layer < dense:
                ref = ref_attention(q, k_all, v_all)
            else:
                heads = []
                for g in range(HKV):
                    qg = q[g * group:(g + 1) * group]
                    idx = sorted(keep(qg, k_all[:, g], n))
                    p = torch.softmax(qg @ k_all[idx, g].T * SCALE, -1)
                    heads.append(p @ v_all[idx, g])
                ref = torch.cat(heads)
            torch.testing.assert_close(outs[layer][row].double(), ref, rtol=1e-5, atol=1e-5)


def test_per_layer_selection_follows_its_rule():
    """Each layer from dense_layers up attends, per KV head, over that head's own top positions: its outputs equal
    exact attention restricted to the reference rule's positions (and differ from TidalDecode's shared choice)."""
    lens, qlens = [100, 70, 41, 6, 30], [1, 1, 1, 1, 4]
    budget, window, dense = 0.25, 4, 2
    cache, meta, tables = paged_batch(lens, qlens, seed=7)
    qs, outs = run_layers(sparse_backend(budget=budget, window=window, dense_layers=dense), cache, meta)
    (step,) = [p for p in meta.plan if isinstance(p, SparseStep)]
    assert step.rows == [0, 1, 2]
    _, tidal = run_layers(sparse_backend(budget=budget, window=window, selection="tidal", selection_layers=(dense,)),
                          cache, meta)
    assert_heads_attend_exactly(outs, qs, cache, tables, meta, step, lens, dense,
                                lambda qg, k, n: ref_top_k(qg, k, math.ceil(budget * n), window))
    for i in step.rows:
        row = int(meta.query_start_loc[i])
        assert not torch.allclose(outs[LAYERS - 1][row], tidal[LAYERS - 1][row], rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(cpu_exact.kernel() is None, reason="needs the CPU kernels (a C++ toolchain)")
@pytest.mark.parametrize("fmt", ["auto", "fp8", "int8", "int4"])
def test_per_layer_kernel_reads_the_cache_in_place(monkeypatch, fmt):
    """per_layer on the CPU runs in one kernel call (attention/cpu_sparse.py) that reads the cache in place (the
    context is never gathered) and attends as the rule's torch formulation does, over the real model's shapes (9
    query heads on 3 KV heads of 64, 16-token blocks) and every cache format (quantized: random codes and grids,
    each row's last block open in the full-precision window, int4 with a salient token per block)."""
    from leapdecode.attention.kv_cache import KVCache
    g = torch.Generator().manual_seed(11)
    lens, bs, hkv, d, h = [700, 300], 16, 3, 64, 9
    nblocks = [-(-n // bs) for n in lens]
    cache = KVCache(1, sum(nblocks) + 2, bs, hkv, d, torch.float32, torch.device("cpu"), kv_cache_dtype=fmt,
                    window_blocks=2, num_salient=1)
    if fmt == "auto":
        cache.data.normal_(generator=g)
    else:
        codes = torch.randint(0, 256, cache.data.shape, generator=g, dtype=torch.uint8)
        if fmt == "fp8":                            # no NaN (e4m3's 0x7f and 0xff)
            codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)
        cache.data.copy_(codes)
        if cache.scales is not None:
            cache.scales.copy_(torch.rand(cache.scales.shape, generator=g) * 0.01 + 0.001)
        if fmt != "fp8":
            cache.key_grid[:, :, 0].normal_(generator=g)
            cache.key_grid[:, :, 1].copy_(torch.rand(cache.key_grid[:, :, 1].shape, generator=g) * 0.02)
            cache.value_grid[:, :, 0].normal_(generator=g)
            cache.value_grid[:, :, 1].copy_(torch.rand(cache.value_grid[:, :, 1].shape, generator=g) * 0.02)
            cache.salient.copy_(torch.randint(0, bs, cache.salient.shape, generator=g, dtype=torch.uint8))
            cache.residual.copy_(torch.randint(0, 256, cache.residual.shape, generator=g, dtype=torch.uint8))
    perm = torch.randperm(sum(nblocks), generator=g).tolist()
    tables = [perm[:nblocks[0]], perm[nblocks[0]:]]
    width = max(nblocks)
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in lens]), block_tables=torch.tensor([t + [0] * (width - len(t))
                                                                                   for t in tables]),
        seq_lens=torch.tensor(lens), slot_mapping=torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs
                                                                 for t, n in zip(tables, lens)]),
        query_start_loc=torch.arange(3), query_lens=[1, 1], seq_lens_host=list(lens), block_size=bs,
        num_actual_tokens=2)
    if cache.layout.windowed:
        cache.window.normal_(generator=g)
        meta.kv_window = torch.full((2, width), -1)
        for row, n in enumerate(lens):
            meta.kv_window[row, (n - 1) // bs] = row
    step = SparseStep(SparseAttention(SparseAttentionConfig(budget=0.1, window=32, dense_layers=0), 1), meta, [0, 1])
    q = torch.randn(2, h, d, generator=g)
    gathers = []
    monkeypatch.setattr(SparseStep, "_context", lambda self, kv, values=True, _orig=SparseStep._context:
                        gathers.append(1) or _orig(self, kv, values))
    got = step.attend(q, cache.layer(0), d ** -0.5, layer=0)
    assert not gathers
    monkeypatch.setattr(SparseStep, "_native", lambda self, q, kv: False)     # the torch formulation
    want = step.attend(q, cache.layer(0), d ** -0.5, layer=0)
    assert gathers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def record_all(backend, cache, meta, tables, lens):
    """pages: fold every position's key into the page bounds, as the backend's write_kv does while a model runs."""
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, n in zip(tables, lens) for p in range(n)])
    for layer in range(LAYERS):
        keys = cache[layer, 0].flatten(0, 1)[slots]
        backend.sparse.record_keys(layer, keys, slots, cache[layer], BS)


def test_page_bounds_are_each_blocks_key_minimum_and_maximum():
    """record_keys keeps, per block, exactly the minimum and maximum of the keys written into it since its first
    offset was (re)written, across writes in any order of steps; padding slots are ignored."""
    backend = sparse_backend(budget=8, window=2, selection="pages", dense_layers=0)
    cache = torch.zeros(2, 4, BS, HKV, D)
    g = torch.Generator().manual_seed(12)
    written: dict[int, list[torch.Tensor]] = {}
    for slots in ([0, 1, 2, 8, 9], [3, 4, -1, 10], [16, 17], [8, 11], [5, 6, 7, 24]):  # block 1 restarts at slot 8
        k = torch.randn(len(slots), HKV, D, generator=g)
        backend.sparse.record_keys(0, k, torch.tensor(slots), cache, BS)
        for s, row in zip(slots, k):
            if s >= 0:
                if s % BS == 0:
                    written[s // BS] = []
                written[s // BS].append(row)
    lo, hi = backend.sparse.page_bounds[0]
    for block, rows in written.items():
        torch.testing.assert_close(lo[block], torch.stack(rows).amin(0))
        torch.testing.assert_close(hi[block], torch.stack(rows).amax(0))


def test_pages_selection_follows_its_rule():
    """pages (Quest): each KV head bounds every page before the window's first page by the most any query of its
    group can score there (sum over channels of max(q * min, q * max)) and attends over its top pages, enough for the
    budget, plus the window's pages: its outputs equal exact attention over those tokens."""
    lens, qlens = [100, 70, 41, 6, 30], [1, 1, 1, 1, 4]
    budget, window, dense = 0.25, 4, 2
    cache, meta, tables = paged_batch(lens, qlens, seed=8)
    backend = sparse_backend(budget=budget, window=window, dense_layers=dense, selection="pages")
    record_all(backend, cache, meta, tables, lens)
    qs, outs = run_layers(backend, cache, meta)
    (step,) = [p for p in meta.plan if isinstance(p, SparseStep)]
    assert step.rows == [0, 1, 2]

    def keep(qg, k, n):                      # Quest's bound per page, its top pages, and the window's pages
        first_window, pages = (n - window) // BS, math.ceil(math.ceil(budget * n) / BS)
        bounds = [torch.maximum(qg * k[p * BS:(p + 1) * BS].min(0).values,
                                qg * k[p * BS:(p + 1) * BS].max(0).values).sum(-1).max().item()
                  for p in range(first_window)]
        chosen = sorted(range(first_window), key=lambda p: -bounds[p])[:pages]
        return {t for p in chosen for t in range(p * BS, (p + 1) * BS)} | set(range(first_window * BS, n))

    assert_heads_attend_exactly(outs, qs, cache, tables, meta, step, lens, dense, keep)


def test_pages_covering_every_page_reproduce_full_attention():
    lens = [100, 61]
    cache, meta, tables = paged_batch(lens, [1, 1], seed=9)
    backend = sparse_backend(budget=92, window=4, dense_layers=1, selection="pages")   # 12 pages: all candidates
    record_all(backend, cache, meta, tables, lens)
    _, sparse = run_layers(backend, cache, meta)
    assert [p for p in meta.plan if isinstance(p, SparseStep)][0].rows == [0]
    _, full = run_layers(TorchAttention(), cache, meta)
    for a, b in zip(sparse, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [{"dense_layers": 1}, {"selection": "tidal", "selection_layers": (1, 3)},
                                 {"dense_layers": 1, "selection": "pages"}], ids=["per_layer", "tidal", "pages"])
def test_a_quantized_cache_is_read_as_its_dequantized_values(cfg):
    """Sparse rows over an fp8 cache attend exactly as over a full-precision cache holding its dequantized values."""
    from leapdecode.attention.kv_cache import Fp8Layer
    from leapdecode.attention.kv_quant import fp8_decode, fp8_scale, fp8_encode
    lens = [90, 60]
    cache, meta, tables = paged_batch(lens, [1, 1], seed=8)
    L, _, nb, bs, h, d = cache.shape
    flat = cache.view(L, 2, nb * bs, h, d)
    scales = fp8_scale(flat)                                                        # [L, 2, slots, h]
    codes = fp8_encode(flat, scales)
    fp8 = [Fp8Layer(codes[i].view(2, nb, bs, h, d), scales[i].view(2, nb, bs, h), torch.float32) for i in range(L)]
    dequantized = fp8_decode(codes, scales, torch.float32).view(cache.shape)
    backend = sparse_backend(budget=0.2, window=4, **cfg)
    if backend.sparse.pages:
        record_all(backend, dequantized, meta, tables, lens)
    g = torch.Generator().manual_seed(9)
    qs = [torch.randn(2, H, D, generator=g) for _ in range(LAYERS)]
    backend.plan(meta)
    got = [backend.attend(qs[i], fp8[i], meta, SCALE, layer=i) for i in range(LAYERS)]
    backend.plan(meta)
    want = [backend.attend(qs[i], dequantized[i], meta, SCALE, layer=i) for i in range(LAYERS)]
    assert any(isinstance(p, SparseStep) for p in meta.plan)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- through the engine -------------------------------------------------------------------------------------------

TIDAL = {"budget": 16, "window": 4, "selection": "tidal", "selection_layers": (1, 3)}
PER_LAYER = {"budget": 16, "window": 4, "dense_layers": 1}
PAGES = {"budget": 16, "window": 4, "dense_layers": 1, "selection": "pages"}
MODES = pytest.mark.parametrize("sparse", [PER_LAYER, TIDAL, PAGES], ids=["per_layer", "tidal", "pages"])
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def deep_dir(tiny_dir):
    return tiny_dir("llama", num_hidden_layers=6)


def long_prompts(lens=(300, 140, 220, 10), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in lens]


def run(llm, prompts):
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def full_outputs(deep_dir):
    return run(make_llm(deep_dir, max_model_len=512), long_prompts())


@pytest.mark.parametrize("budget", [1.0, 512])
@MODES
def test_generate_with_a_budget_covering_the_context_is_bit_for_bit_full(deep_dir, full_outputs, budget, sparse):
    llm = make_llm(deep_dir, max_model_len=512, sparse_attention={**sparse, "budget": budget})
    assert run(llm, long_prompts()) == full_outputs
    assert_pool_free(llm)


@MODES
def test_small_budget_is_lossy_but_batch_invariant_prefix_cache_safe_and_leak_free(deep_dir, full_outputs, sparse):
    llm = make_llm(deep_dir, max_model_len=512, sparse_attention=sparse)
    prompts = long_prompts()
    batched = run(llm, prompts)
    # the feature is on: every long prompt's outputs move; the 10-token prompt attends fully (exactly) until its
    # context passes budget + window = 20 keys, i.e. for its first 11 tokens
    assert all(b[1] != f[1] for b, f in zip(batched[:3], full_outputs[:3]))
    assert batched[3][0][:11] == full_outputs[3][0][:11]
    alone = [run(llm, [p])[0] for p in prompts]                    # (prefix-cache hits: the prompts ran before)
    cold = run(make_llm(deep_dir, max_model_len=512, sparse_attention=sparse, enable_prefix_caching=False), prompts)
    for other in (alone, cold):
        assert [t for t, _ in other] == [t for t, _ in batched]
        assert [lp for _, lp in other] == pytest.approx([lp for _, lp in batched], rel=1e-5)
    assert_pool_free(llm)


@MODES
def test_verification_rows_keep_full_attention(deep_dir, full_outputs, sparse):
    """A draft every step (some of it wrong) makes every row a verification row, so outputs are full attention's;
    all but the last token, which has no room left for a draft and is a (sparse) decode."""
    prompts = long_prompts()
    truth = {tuple(p): [t] for p, (t, _) in zip(prompts, full_outputs)}
    spec = SpeculativeConfig(drafter=OracleDrafter(truth, wrong_every=3), num_speculative_tokens=3, adaptive=False)
    llm = make_llm(deep_dir, max_model_len=512, sparse_attention=sparse, speculative_config=spec)
    assert [t[:-1] for t, _ in run(llm, prompts)] == [t[:-1] for t, _ in full_outputs]
    assert_pool_free(llm)


@MODES
def test_layer_skip_drafting_runs_on_the_sparse_backend(deep_dir, sparse):
    """The layer-skip drafter runs the target's layers (its selection layer skipped) through the same backend."""
    spec = {"method": "layer_skip", "num_speculative_tokens": 3, "adaptive": False, "skip": [1, 2],
            "threshold": 0.0}
    llm = make_llm(deep_dir, max_model_len=512, sparse_attention=sparse, speculative_config=spec)
    outs = llm.generate(long_prompts((150, 60)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert llm.engine.stats["draft_tokens"] > 0
    assert_pool_free(llm)


def test_page_bounds_are_kept_for_selecting_layers_and_counted_in_the_budget(deep_dir):
    """pages: only the layers that select keep bounds, and their bytes are part of the KV budget and of
    ``kv_cache_info()`` (the same memory holds fewer blocks than with per_layer selection)."""
    memory = 4 << 20
    pages = make_llm(deep_dir, max_model_len=512, sparse_attention=PAGES, kv_cache_memory=memory)
    plain = make_llm(deep_dir, max_model_len=512, sparse_attention={"selection": "per_layer"}, kv_cache_memory=memory)
    run(pages, long_prompts((150,), seed=4))
    sparse, cfg = pages.engine.runner.backend.sparse, pages.engine.runner._kv_view
    assert set(sparse.page_bounds) == set(sparse.selection_layers) == set(range(1, 6))    # dense_layers=1
    per_block = 2 * len(sparse.selection_layers) * cfg.num_kv_heads * cfg.head_dim * 4
    info, other = pages.kv_cache_info(), plain.kv_cache_info()
    assert info["page_bounds_bytes"] == info["num_blocks"] * per_block and other["page_bounds_bytes"] == 0
    assert info["num_blocks"] == memory // (info["bytes_per_block"] + per_block) < other["num_blocks"]
    assert info["total_bytes"] <= memory


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_page_bounds_hold_keys_that_kv_moves_bring(deep_dir, kv_cache_dtype):
    """pages: keys copied into another block (a beam fork's copy of its parent's partial block; a windowed cache
    moves window slots) are folded into that block's bounds, so every cached block's bounds contain its keys.
    Without the fold a forked block keeps the bounds of whatever it held before (fails)."""
    from leapdecode.decoding.beam_search import BeamSearchParams
    llm = make_llm(deep_dir, max_model_len=512, sparse_attention=PAGES, kv_cache_dtype=kv_cache_dtype)
    prompts = long_prompts((37, 58), seed=6)
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=24))
    runner, bm = llm.engine.runner, llm.engine.block_manager
    sparse = runner.backend.sparse
    llm.engine._apply_late_seals()                        # (finished beams' recent blocks, int8)
    checked = 0
    for block in sorted(set(bm.cached.values())):
        slots = torch.arange(block * 16, block * 16 + 16)
        for layer, (lo, hi) in sparse.page_bounds.items():
            if kv_cache_dtype == "auto":
                keys, tol = runner.kv_cache.keys_at(layer, slots).float(), 1e-6
            else:     # sealed: the pool's keys, within half a step of the 255-level grid over [min, max]
                keys = runner.kv_cache.layer(layer).read(torch.tensor([[block]]), None)[0][0].float()
                tol = (hi[block] - lo[block]) / 255 + 1e-3
            assert bool((lo[block] <= keys.amin(0) + tol).all() and (hi[block] >= keys.amax(0) - tol).all()), \
                (block, layer)
        checked += 1
    assert checked >= 4
    assert_pool_free(llm)


def test_imported_blocks_get_their_page_bounds(deep_dir):
    """pages: KV blocks imported from another engine (disaggregated prefill) are bounded like written ones, so the
    importer chooses the exporter's pages and decodes its tokens."""
    prompt = long_prompts((200,), seed=3)[0]
    a, b = (make_llm(deep_dir, max_model_len=512, sparse_attention=PAGES) for _ in range(2))
    run(a, [prompt])
    assert b.import_kv(a.export_kv(prompt)) == 192
    ours, theirs = (x.engine.block_manager.cached_blocks(prompt) for x in (a, b))
    assert len(ours) == len(theirs) == 12
    for layer, (lo, hi) in a.engine.runner.backend.sparse.page_bounds.items():
        lo_b, hi_b = b.engine.runner.backend.sparse.page_bounds[layer]
        assert torch.equal(lo[ours], lo_b[theirs]) and torch.equal(hi[ours], hi_b[theirs])
    assert run(b, [prompt]) == run(a, [prompt])
    for llm in (a, b):
        assert_pool_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8", "int4"])
def test_sparse_decoding_over_a_quantized_cache(deep_dir, kv_cache_dtype):
    """Both lossy features together: sparse rows read the quantized cache (int8/int4 open blocks from the window);
    with a budget covering the context the outputs are the quantized cache's own, with a small one they move."""
    prompts = long_prompts((300, 140))
    plain = run(make_llm(deep_dir, max_model_len=512, kv_cache_dtype=kv_cache_dtype), prompts)
    covering = make_llm(deep_dir, max_model_len=512, kv_cache_dtype=kv_cache_dtype, sparse_attention={"budget": 1.0})
    assert run(covering, prompts) == plain
    for sparse in (PER_LAYER, TIDAL, PAGES):
        llm = make_llm(deep_dir, max_model_len=512, kv_cache_dtype=kv_cache_dtype, sparse_attention=sparse)
        outs = run(llm, prompts)
        assert all(len(t) == PARAMS.max_tokens for t, _ in outs)
        assert all(o[1] != p[1] for o, p in zip(outs, plain))
        assert_pool_free(llm)


@pytest.mark.parametrize("cfg, field", [
    ({"budget": 0}, "budget"), ({"budget": -3}, "budget"), ({"budget": 1.5}, "budget"), ({"budget": 0.0}, "budget"),
    ({"budget": True}, "budget"), ({"budget": "10%"}, "budget"),
    *[({"selection": "tidal", "selection_layers": bad}, "selection_layers") for bad in ((), (3, 1), (2, 2), (-1,), 2,
                                                                                       (1.5,))],
    ({"selection": "per_layer", "selection_layers": (2, 12)}, "selection_layers"),   # per_layer has none
    ({"selection": "quest"}, "selection"), ({"dense_layers": -1}, "dense_layers"), ({"dense_layers": 1.0},
                                                                                     "dense_layers"),
    ({"window": 0}, "window"), ({"window": 2.0}, "window"), ({"budgets": 3}, "budgets"),
])
def test_bad_parameters_name_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        SparseAttentionConfig.from_any(cfg)


def test_bad_parameters_at_engine_start(deep_dir, tiny_dir):
    with pytest.raises(ValueError, match="selection_layers"):
        make_llm(deep_dir, sparse_attention={"selection": "tidal", "selection_layers": (2, 6)})   # 6 layers
    with pytest.raises(ValueError, match="dense_layers"):
        make_llm(deep_dir, sparse_attention={"dense_layers": 6})
    with pytest.raises(ValueError, match="sparse_attention must be"):
        make_llm(deep_dir, sparse_attention=0.1)
    with pytest.raises(ValueError, match="sliding-window"):
        make_llm(tiny_dir("mistral"), sparse_attention={"budget": 8})
    with pytest.raises(ValueError, match="sparse_attention runs on the torch"):
        get_backend("triton", torch.device("cpu"), SparseAttention(SparseAttentionConfig(), 6))
    tidal = SparseAttentionConfig(selection="tidal")
    assert tidal.layers_for(30) == (2, 12) and tidal.layers_for(32) == (2, 13)
    # selection layers alone mean tidal (the API before per_layer existed); no selection at all means per_layer
    assert SparseAttentionConfig(selection_layers=(2, 9)).selection == "tidal"
    assert SparseAttentionConfig().selection == "per_layer"
    assert SparseAttentionConfig().layers_for(5) == (2, 3, 4)


def test_cli_flags(capsys):
    from leapdecode.cli import _sparse_attention, build_parser, main
    args = build_parser().parse_args(["generate", "--sparse-attention", "0.1", "--sparse-selection", "tidal",
                                      "--sparse-selection-layers", "2", "9", "--sparse-window", "8", "x"])
    assert _sparse_attention(args) == SparseAttentionConfig(budget=0.1, selection_layers=(2, 9), window=8,
                                                            selection="tidal")
    args = build_parser().parse_args(["generate", "--sparse-attention", "0.05", "--sparse-dense-layers", "3", "x"])
    assert _sparse_attention(args) == SparseAttentionConfig(budget=0.05, dense_layers=3, selection="per_layer")
    args = build_parser().parse_args(["generate", "--sparse-attention", "0.1", "--sparse-selection-layers", "2",
                                      "--sparse-window", "8", "x"])
    assert _sparse_attention(args).selection == "tidal"
    assert _sparse_attention(build_parser().parse_args(["generate", "--sparse-attention", "256", "x"])).budget == 256
    assert _sparse_attention(build_parser().parse_args(["generate", "x"])) is None
    assert main(["generate", "--sparse-attention", "0", "x"]) == 2
    assert "sparse_attention.budget" in capsys.readouterr().err
