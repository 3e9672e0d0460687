"""Triton attention kernels against a float64 reference written here in plain torch (gathered K/V, explicit mask).

Without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``, set before the kernels are
defined), on tiny shapes; with CUDA the same checks run compiled on the GPU, plus larger shapes and an engine test
(greedy outputs with the triton backend equal the torch backend). Inputs are fresh random numbers everywhere (the
whole cache, including blocks no sequence owns), block ids are shuffled and unused block-table entries hold junk,
so a wrong page, offset or mask shows up as a wrong number.
"""
from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    # Must be set before triton.jit runs on our kernels; it stays set for the process (triton reads it lazily).
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
from leapdecode.attention import triton_kernels as tk  # noqa: E402
from leapdecode.attention.backend import AttentionMetadata  # noqa: E402
from leapdecode.attention.triton_backend import TritonAttention  # noqa: E402

if not CUDA and not tk.INTERPRETED:
    pytest.skip("triton kernels were compiled for a GPU before this module could select the interpreter",
                allow_module_level=True)


def _interpreter_runs_loops() -> bool:
    """triton 3.6's interpreter (at least) cannot take a loaded value as a loop bound with NumPy 2.4 (int() of a
    1-element array); the kernels need that, so such installs skip rather than fail."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(n_ptr, out_ptr):
        acc = 0
        for i in range(0, tl.load(n_ptr)):
            acc += i
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        probe[(1,)](torch.tensor([4], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001 - any failure here means this interpreter cannot run our kernels
        return False
    return int(out) == 6


if not CUDA and not _interpreter_runs_loops():
    pytest.skip("this triton's CPU interpreter cannot run loops with loaded bounds (seen: triton 3.6 with NumPy "
                "2.4; 3.9 works): pip install -U triton", allow_module_level=True)

DEV = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


# -- cases ------------------------------------------------------------------------------------------------------
def tree_chunk(n: int, ctx: int, rng: random.Random, parents: list[int] | None = None):
    """A chunk of ``n`` tokens ending in a token tree (random unless ``parents`` is given): c >= 1 committed tokens
    (causal), then draft nodes at (last committed position + depth) that see the committed tokens, their ancestors
    and themselves. Returns (positions, [n, n] mask)."""
    if parents is None:
        c = rng.randint(1, max(1, n - 2))
        parents = [-1] + [rng.randint(-1, k - 1) for k in range(1, n - c)]
    c = n - len(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    positions = list(range(ctx, ctx + c)) + [ctx + c - 1 + d for d in depth]
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    mask[c:, c:] = False
    for k, p in enumerate(parents):
        mask[c + k, c + k] = True
        if p >= 0:
            mask[c + k, c:] |= mask[c + p, c:]
    return positions, mask


def make_case(seed, ctx_lens, q_lens, hkv, group, d, block_size, dtype, window=None, trees=()):
    """A ragged batch over a paged cache whose keys are already written. ``trees``: sequence indices that end in a
    random token tree, or {index: parents}. Returns (q, kv_cache, meta)."""
    trees = trees if isinstance(trees, dict) else {i: None for i in trees}
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    need = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 2
    tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g, dtype=torch.int32)   # junk ("holes")
    for i, k in enumerate(need):
        tables[i, :k] = torch.tensor(perm[sum(need[:i]):sum(need[:i]) + k], dtype=torch.int32)
    positions, tree_masks, qsl = [], {}, [0]
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        if i in trees:
            pos, tree_masks[i] = tree_chunk(n, c, rng, trees[i])
        else:
            pos = list(range(c, c + n))
        positions += pos
        qsl.append(qsl[-1] + n)
    slots = [int(tables[i, j // block_size]) * block_size + j % block_size
             for i, (c, n) in enumerate(zip(ctx_lens, q_lens)) for j in range(c, c + n)]
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = (1.5 * torch.randn(qsl[-1], hkv * group, d, generator=g)).to(dtype)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long), slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_lens=list(q_lens), seq_lens_host=seq_lens,
        block_size=block_size, num_actual_tokens=qsl[-1], sliding_window=window)
    return q.to(DEV), kv_cache.to(DEV), with_trees(to_device(meta), tree_masks)


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        meta, positions=meta.positions.to(DEV), slot_mapping=meta.slot_mapping.to(DEV),
        block_tables=meta.block_tables.to(DEV), seq_lens=meta.seq_lens.to(DEV),
        query_start_loc=meta.query_start_loc.to(DEV))


def with_trees(meta: AttentionMetadata, tree_masks: dict) -> AttentionMetadata:
    """The metadata with per-sequence [q, q] tree masks packed as the runner packs them."""
    if not tree_masks:
        return dataclasses.replace(meta, tree_mask=None, tree_offsets=None, tree_offsets_host=None)
    flat, offsets = tk.pack_tree_masks(tree_masks, meta.num_seqs, DEV)
    return dataclasses.replace(meta, tree_mask=flat.bool(), tree_offsets=offsets.long(),
                               tree_offsets_host=offsets.tolist())


def reference(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """float64 attention, one sequence and one query at a time, straight from the visibility rule."""
    q, kv_cache = q.cpu().double(), kv_cache.cpu().double()
    pos_all, tables = meta.positions.cpu(), meta.block_tables.cpu().long()
    H, hkv, bs = q.shape[1], kv_cache.shape[3], meta.block_size
    head_to_kv = torch.arange(H) // (H // hkv)
    out = torch.zeros_like(q)
    start = 0
    for b, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens_host)):
        ctx = L - n
        j = torch.arange(L)
        k = kv_cache[0, tables[b, j // bs], j % bs][:, head_to_kv]          # [L, H, D]
        v = kv_cache[1, tables[b, j // bs], j % bs][:, head_to_kv]
        key_pos = j.clone()
        key_pos[ctx:] = pos_all[start:start + n]
        for i in range(n):
            p = int(pos_all[start + i])
            visible = key_pos <= p
            if meta.tree(b) is not None:
                visible[ctx:] = meta.tree(b)[i].cpu()
            if meta.sliding_window is not None:
                visible &= key_pos > p - meta.sliding_window
            scores = torch.einsum("hd,khd->hk", q[start + i], k[visible]) * scale
            out[start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[visible])
        start += n
    return out


def check(out, ref, dtype):
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]} ({dtype})"


def run_decode(q, kv_cache, meta, scale, **kw):
    return tk.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     meta.positions, scale, max_seq_len=max(meta.seq_lens_host),
                                     sliding_window=meta.sliding_window, **kw)


def run_prefill(q, kv_cache, meta, scale, **kw):
    has_tree = meta.tree_mask is not None
    return tk.paged_prefill_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      meta.positions, scale, max_query_len=max(meta.query_lens),
                                      sliding_window=meta.sliding_window,
                                      tree_mask=meta.tree_mask.to(torch.uint8) if has_tree else None,
                                      tree_offsets=meta.tree_offsets.to(torch.int32) if has_tree else None, **kw)


# (ctx lens, hkv, group, head dim, block size, dtype, window, num_splits)
DECODE_CASES = [
    ([0, 16, 49], 2, 1, 64, 16, torch.float32, None, None),       # MHA, a fresh sequence, one slice
    ([40, 7], 1, 4, 128, 32, torch.bfloat16, None, 3),            # MQA-like group 4, d=128, three slices
    ([70, 33, 5], 2, 2, 64, 16, torch.float16, 20, 4),            # sliding window + slices (some empty)
    ([23], 2, 7, 32, 16, torch.float32, None, 5),                 # group 7 (Qwen2.5-0.5B's ratio), odd lengths
    ([300], 1, 2, 64, 16, torch.bfloat16, None, None),            # slices chosen by the heuristic (3 here)
]


@pytest.mark.parametrize("ctx_lens,hkv,group,d,bs,dtype,window,splits", DECODE_CASES)
def test_decode_matches_float64(ctx_lens, hkv, group, d, bs, dtype, window, splits):
    q, kv, meta = make_case(1, ctx_lens, [1] * len(ctx_lens), hkv, group, d, bs, dtype, window)
    scale = d ** -0.5
    check(run_decode(q, kv, meta, scale, num_splits=splits), reference(q, kv, meta, scale), dtype)


def test_decode_subset_leaves_other_rows_alone():
    """seq_ids selects decode rows inside a mixed batch; rows of other sequences in ``out`` are not written."""
    q, kv, meta = make_case(2, [9, 20, 3], [1, 3, 1], 2, 2, 32, 16, torch.float32)
    out = torch.full_like(q, 7.0)
    ids = torch.tensor([0, 2], dtype=torch.int32, device=DEV)
    tk.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.positions,
                              0.2, seq_ids=ids, num_splits=2, out=out)
    ref = reference(q, kv, meta, 0.2)
    rows = [0, 4]
    check(out[rows], ref[rows], torch.float32)
    assert bool((out[1:4] == 7.0).all())


# (ctx lens, q lens, hkv, group, head dim, block size, dtype, window, tree sequences)
PREFILL_CASES = [
    ([0, 10, 30, 17], [20, 3, 5, 1], 2, 2, 64, 16, torch.float32, None, ()),   # first chunk, verify rows, decode
    ([12, 40], [5, 4], 2, 4, 128, 32, torch.bfloat16, None, (0, 1)),           # token trees, GQA 4, d=128
    ([25, 0], [4, 37], 1, 1, 64, 16, torch.float16, 16, (0,)),                 # sliding window (+ a tree)
    ([3], [2], 4, 2, 16, 16, torch.float32, None, ()),                         # tiny head dim
    # window shorter than the tree: an ancestor two levels up is out of the window, though near by index
    ([10, 6], [7, 2], 1, 2, 32, 16, torch.float32, 2, {0: [-1, -1, -1, 2, 3]}),
]


@pytest.mark.parametrize("ctx_lens,q_lens,hkv,group,d,bs,dtype,window,trees", PREFILL_CASES)
def test_prefill_and_verify_match_float64(ctx_lens, q_lens, hkv, group, d, bs, dtype, window, trees):
    q, kv, meta = make_case(3, ctx_lens, q_lens, hkv, group, d, bs, dtype, window, trees)
    scale = d ** -0.5
    check(run_prefill(q, kv, meta, scale), reference(q, kv, meta, scale), dtype)


def test_prefill_arbitrary_step_mask():
    """The tree-mask region is taken as given, whatever it allows (here: random, later tokens included)."""
    q, kv, meta = make_case(7, [5, 20], [11, 3], 2, 2, 32, 16, torch.float32)
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(11, 11, generator=g) < 0.5
    mask.fill_diagonal_(True)
    meta = with_trees(meta, {0: mask.to(DEV)})
    # 16-row tiles = 8 tokens: the first tile must still reach the keys of tokens 8..10
    check(run_prefill(q, kv, meta, 0.3, tune={"block_m": 16}), reference(q, kv, meta, 0.3), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_by_slot_mapping(dtype):
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 6, 16, 2, 32, generator=g).to(dtype).to(DEV)
    before = cache.clone()
    # k/v come in the cache dtype, as in the engine (the interpreter truncates fp32 -> bf16 casts; GPUs round)
    k = torch.randn(5, 2, 32, generator=g).to(dtype).to(DEV)
    v = torch.randn(5, 2, 32, generator=g).to(dtype).to(DEV)
    slots = torch.tensor([17, -1, 90, 3, -1], device=DEV)
    tk.write_kv_triton(k, v, cache, slots)
    expect = before.clone().view(2, 96, 2, 32)
    expect[0, [17, 90, 3]] = k[[0, 2, 3]]
    expect[1, [17, 90, 3]] = v[[0, 2, 3]]
    assert torch.equal(cache.view(2, 96, 2, 32), expect)           # padding slots wrote nowhere


def test_backend_mixed_batch_write_then_attend():
    """The seam end to end: write this step's K/V, then attend for decodes, verify rows, a tree and a prefill."""
    hkv, group, d, bs = 2, 2, 32, 16
    q, kv, meta = make_case(5, [30, 0, 8, 19], [1, 12, 4, 1], hkv, group, d, bs, torch.float32, trees=(2,))
    g = torch.Generator().manual_seed(6)
    T = q.shape[0]
    k_new = torch.randn(T, hkv, d, generator=g).to(DEV)
    v_new = torch.randn(T, hkv, d, generator=g).to(DEV)
    backend = TritonAttention()
    backend.plan(meta)
    plan = meta.plan
    backend.write_kv(k_new, v_new, kv, meta)
    out = backend.attend(q, kv, meta, 0.25)
    assert backend.attend(q, kv, meta, 0.25) is not out and meta.plan is plan      # one plan for every layer
    check(out, reference(q, kv, meta, 0.25), torch.float32)
    flat = kv.view(2, -1, hkv, d)
    assert torch.equal(flat[0, meta.slot_mapping], k_new) and torch.equal(flat[1, meta.slot_mapping], v_new)


# -- fp8 caches: codes dequantized as the tiles load ------------------------------------------------------------
def fp8_case(kv_cache):
    """(uint8 codes, float16 scales) of a float cache [2, blocks, bs, hkv, d], and the values they decode to
    (kv_quant's reference, in the cache's dtype): the kernels must attend over exactly those."""
    from leapdecode.attention import kv_quant as kq
    codes, scales = kq.fp8_quantize(kv_cache.cpu())
    return codes.to(DEV), scales.to(DEV), kq.fp8_decode(codes, scales, kv_cache.dtype)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_fp8_cache_decode_and_prefill_match_float64(case):
    """Decode (split and not) and prefill/verification rows (trees, a sliding window) over an fp8 cache equal
    float64 attention over the dequantized K/V; reading the codes as if they were values is far off."""
    ctx, qlens, hkv, group, d, dtype, window, trees, splits = [
        ([0, 16, 49], [1, 1, 1], 2, 2, 64, torch.float32, None, (), 3),
        ([12, 40, 7], [5, 4, 1], 2, 4, 128, torch.bfloat16, None, (0,), 2),
        ([25, 0], [4, 37], 1, 2, 64, torch.float16, 16, (0,), 1)][case]
    q, kv, meta = make_case(11 + case, ctx, qlens, hkv, group, d, 16, dtype, window, trees)
    codes, scales, deq = fp8_case(kv)
    scale = d ** -0.5
    ref = reference(q, deq, meta, scale)
    if all(n == 1 for n in qlens):
        out = run_decode(q, codes, meta, scale, quant=tk.QuantizedKV("fp8", scales), num_splits=splits)
    else:
        out = run_prefill(q, codes, meta, scale, quant=tk.QuantizedKV("fp8", scales))
    check(out, ref, dtype)
    assert (out.cpu().double() - reference(q, kv, meta, scale)).abs().max() > 0     # (it is lossy: not the floats)
    with pytest.raises(ValueError, match="fp8"):
        run_decode(q, codes, meta, scale, quant=tk.QuantizedKV("fp8", scales[:, :1]))


@pytest.mark.parametrize("decode", [True, False])
def test_fp8_cache_with_a_window_reads_open_blocks_from_it(decode):
    """A windowed fp8 cache (recent tokens): blocks whose table entry names a window block are read from the
    full-precision window, the others dequantized from the pool, exactly as the reference overlays them."""
    ctx, qlens = ([30, 47, 5], [1, 1, 1]) if decode else ([30, 47, 5], [3, 1, 6])
    q, kv, meta = make_case(21 + decode, ctx, qlens, 2, 2, 32, 16, torch.bfloat16, trees=() if decode else (0,))
    codes, scales, deq = fp8_case(kv)
    g = torch.Generator().manual_seed(5)
    window = torch.randn(2, 7, 16, 2, 32, generator=g).to(torch.bfloat16)
    tables = meta.block_tables.cpu().long()
    kv_window = torch.full(tables.shape, -1, dtype=torch.int32)
    eff = deq.clone()
    free = iter(range(7))
    for b, L in enumerate(meta.seq_lens_host):                       # each sequence's last two blocks are open
        for blk in range(max(0, -(-L // 16) - 2), -(-L // 16)):
            w = next(free)
            kv_window[b, blk] = w
            eff[:, tables[b, blk]] = window[:, w]
    args = dict(quant=tk.QuantizedKV("fp8", scales, window=window.to(DEV), table=kv_window.to(DEV)))
    scale = 32 ** -0.5
    out = run_decode(q, codes, meta, scale, num_splits=2, **args) if decode else run_prefill(q, codes, meta, scale,
                                                                                             **args)
    check(out, reference(q, eff, meta, scale), torch.bfloat16)
    assert (out.cpu().double() - reference(q, deq, meta, scale)).abs().max() > 0.05     # the window was read


def int_case(q, kv, fmt: str, salient: int):
    """A one-layer int8/int4 ``KVCache`` whose pool blocks hold ``kv`` [2, blocks, bs, hkv, d] quantized by the
    reference (each block staged in the window and sealed), its ``QuantizedKV`` (no window table yet) and what the
    reference decodes every pool block to, [2, blocks, bs, hkv, d] in kv's dtype."""
    from leapdecode.attention.kv_cache import KVCache
    _, nb, bs, hkv, d = kv.shape
    cache = KVCache(1, nb, bs, hkv, d, kv.dtype, DEV, fmt, nb, salient)
    cache.window[0][:, :nb].copy_(kv)
    ids = torch.arange(nb, device=DEV)
    cache.seal_from_window(ids, ids)
    layer = cache.layer(0)
    k, v = layer._decode(ids[None])
    n = cache.layout.num_salient
    quant = tk.QuantizedKV(fmt, None, layer.key_grid, layer.value_grid, layer.salient if n else None,
                           layer.residual if n else None)
    return layer, quant, torch.stack((k[0], v[0]))


@pytest.mark.parametrize("fmt,salient,decode", [("int8", 0, True), ("int8", 0, False), ("int4", 2, True),
                                                ("int4", 2, False), ("int4", 0, True)])
def test_int_cache_decode_and_prefill_match_the_reference_decode(fmt, salient, decode):
    """int8 / int4 caches (KIVI grids; int4 with and without salient tokens at 8 bits), windowed as they always
    are: the kernels decode each tile exactly as ``kv_quant`` does and read the blocks the table names from the
    window; attention equals float64 attention over those K/V."""
    ctx, qlens = ([30, 47, 5], [1, 1, 1]) if decode else ([30, 47, 5], [3, 1, 6])
    q, kv, meta = make_case(31 + decode, ctx, qlens, 2, 2, 32, 16, torch.float32, trees=() if decode else (0,))
    layer, quant, deq = int_case(q, kv, fmt, salient)
    if salient:
        assert layer.salient.any()                                    # (offsets other than 0 are in play)
    tables = meta.block_tables.cpu().long()
    table = torch.full(tables.shape, -1, dtype=torch.int32)
    eff = deq.clone()
    for b, L in enumerate(meta.seq_lens_host):                        # each sequence's last block is open
        blk = -(-L // 16) - 1
        table[b, blk] = int(tables[b, blk])                           # (window block = its pool block's number)
        eff[:, tables[b, blk]] = kv[:, tables[b, blk]]
    quant = dataclasses.replace(quant, window=layer.window, table=table.to(DEV))
    scale = 32 ** -0.5
    out = run_decode(q, layer.codes, meta, scale, num_splits=2, quant=quant) if decode else \
        run_prefill(q, layer.codes, meta, scale, quant=quant)
    check(out, reference(q, eff, meta, scale), torch.float32)
    assert (out.cpu().double() - reference(q, kv, meta, scale)).abs().max() > 1e-3      # it is lossy


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "int4 salient"])
@pytest.mark.parametrize("d", [32, 24, 20] if not CUDA else [32])      # (on a GPU each variant compiles)
def test_codes_read_several_to_a_load_decode_the_same(fmt, d):
    """Quantized codes (fp8, int8, int4 with and without salient tokens' low nibbles) loaded 2, 4 or 8 bytes to a
    word and unpacked in the kernel (``code_bytes``) give the very outputs of loading them byte by byte, decode and
    prefill, with head dims that fill a word, pad the tile (24 of 32) or do not divide into words (20: fewer bytes
    a load); a wrong unpacking order is far off the reference."""
    ctx, qlens = [30, 47, 5], [1, 1, 1]
    outs = {}
    for decode in (True, False):
        q, kv, meta = make_case(41 + decode, ctx, qlens if decode else [3, 1, 6], 2, 2, d, 16, torch.bfloat16,
                                trees=() if decode else (0,))
        if fmt == "fp8":
            codes, scales, deq = fp8_case(kv)
            quant = tk.QuantizedKV("fp8", scales)
        else:
            layer, quant, deq = int_case(q, kv, fmt.split()[0], 2 if "salient" in fmt else 0)
            codes = layer.codes
        scale = d ** -0.5
        ref = reference(q, deq, meta, scale)
        for cb in (1, 2, 4, 8) if not CUDA else (1, 2, 8):
            tune = dict(code_bytes=cb)
            out = run_decode(q, codes, meta, scale, num_splits=2, quant=quant, tune=tune) if decode else \
                run_prefill(q, codes, meta, scale, quant=quant, tune=tune)
            check(out, ref, torch.bfloat16)
            outs[decode, cb] = out
        for cb in (2, 4, 8) if not CUDA else (2, 8):
            assert torch.equal(outs[decode, cb], outs[decode, 1]), (decode, cb)
    with pytest.raises(ValueError, match="code_bytes"):
        run_decode(q, codes, meta, scale, quant=quant, tune=dict(code_bytes=3))
    odd = torch.zeros(2, 3, 16, 2, 33, dtype=torch.uint8)[..., 1:]      # words would straddle 8-byte boundaries:
    assert tk._code_views(odd, quant, 8, (odd,) * 8)[2] == 1              # read byte by byte, not refused


@pytest.mark.parametrize("fmt", ["int8", "int4 salient"])
def test_key_grids_loaded_per_block_decode_the_same(fmt, monkeypatch):
    """int8/int4 keys' per-channel grids loaded once per block of a tile and broadcast (``grid_per_block``) give
    the very outputs of loading them per key: decode (tiles of whole blocks; with a sliding window it keeps the
    per-key loads) and prefill; a broadcast that crossed blocks would be far off the reference."""
    launched = []

    class Spy:                       # what each launch was told (the outputs alone cannot show the path taken)
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["GRID_BLOCKS"])
                return self.kernel[grid](*args, **kwargs)
            return launch
    for name in ("_decode_partial_kernel", "_prefill_kernel"):
        monkeypatch.setattr(tk, name, Spy(getattr(tk, name)))
    for decode, window in ((True, None), (True, 20), (False, None)):
        launched.clear()
        q, kv, meta = make_case(51 + decode, [30, 47, 5], [1, 1, 1] if decode else [3, 1, 6], 2, 2, 32, 16,
                                torch.float32, window, trees=() if decode else (0,))
        layer, quant, deq = int_case(q, kv, fmt.split()[0], 2 if "salient" in fmt else 0)
        scale = 32 ** -0.5
        outs = []
        for per_block in (False, True):
            tune = dict(grid_per_block=per_block, block_n=32)      # (tiles of two 16-key blocks)
            out = run_decode(q, layer.codes, meta, scale, num_splits=2, quant=quant, tune=tune) if decode else \
                run_prefill(q, layer.codes, meta, scale, quant=quant, tune=tune)
            check(out, reference(q, deq, meta, scale), torch.float32)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (decode, window)
        assert launched == [False, window is None], (decode, window)


def test_fp8_backend_writes_like_the_reference_and_attends():
    """TritonAttention on an ``Fp8Layer``: the write stores the reference quantizer's codes and scales at the slots
    (padding slots nowhere), and attention equals the torch backend's on the same cache."""
    from leapdecode.attention.kv_cache import Fp8Layer
    from leapdecode.attention.torch_ref import TorchAttention
    hkv, group, d, bs = 2, 2, 32, 16
    q, kv, meta = make_case(9, [30, 0, 8, 19], [1, 12, 4, 1], hkv, group, d, bs, torch.float32, trees=(2,))
    codes, scales, _ = fp8_case(kv)
    layers = [Fp8Layer(codes.clone(), scales.clone(), torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(10)
    T = q.shape[0]
    k_new = torch.randn(T, hkv, d, generator=g).to(DEV)
    v_new = torch.randn(T, hkv, d, generator=g).to(DEV)
    outs = []
    for backend, layer in zip((TritonAttention(), TorchAttention()), layers):
        backend.plan(meta)
        backend.write_kv(k_new, v_new, layer, meta)
        outs.append(backend.attend(q, layer, meta, 0.25))
    assert torch.equal(layers[0].codes, layers[1].codes) and torch.equal(layers[0].scales, layers[1].scales)
    assert not torch.equal(layers[0].codes, codes)                          # the step's K/V were written
    check(outs[0], outs[1].cpu().double(), torch.float32)
    # padding (negative slots) writes nowhere
    layer = Fp8Layer(codes.clone(), scales.clone(), torch.float32)
    padded = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
    TritonAttention().write_kv(k_new, v_new, layer, padded)
    assert torch.equal(layer.codes, codes) and torch.equal(layer.scales, scales)


def test_choose_num_splits():
    assert tk.choose_num_splits(1, 8, 128 * 1024, 132) == 64                 # batch 1, long context: many slices
    assert tk.choose_num_splits(1, 8, 200, 132) == 2                         # short context: few keys per slice
    assert tk.choose_num_splits(64, 8, 128 * 1024, 132) == 2                 # large batch: the grid is full
    assert tk.choose_num_splits(256, 8, 2048, 132) == 1


def test_engine_greedy_equals_torch_backend_under_interpreter(tiny_dir, monkeypatch):
    """The whole engine on the Triton backend (interpreted on CPU, compiled on CUDA): chunked prefill, a sliding
    window shorter than the prompts (Mistral config, window 24), n-gram speculation (verification rows) and decode
    give the torch backend's greedy tokens."""
    out = engine_tokens(tiny_dir, monkeypatch, "mistral", spec="ngram", n_prompts=3, max_tokens=8, max_len=40)
    assert out["triton"] == out["torch"]


def test_engine_quantized_caches_on_triton_equal_torch_backend(tiny_dir):
    """Every quantized kv_cache_dtype through the whole engine on the Triton backend (chunked prefill, n-gram
    verification rows, decode): fp8 with and without recent tokens, int8, int4 with salient tokens (windowed:
    blocks sealing as the sequences grow) give the torch backend's greedy tokens on the same quantized cache."""
    from leapdecode import LLM, SamplingParams
    path = tiny_dir("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for fmt, recent in (("fp8", 0), ("fp8", 16), ("int8", 0), ("int4", 16)):
        outs = {}
        for name in ("torch", "triton"):
            llm = LLM(path, dtype="float32", device=DEV.type, max_model_len=256, max_num_batched_tokens=32,
                      kv_cache_dtype=fmt, kv_cache_recent_tokens=recent, attention_backend=name,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
            assert llm.engine.runner.backend.name == name
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.block_manager.windowed == (fmt != "fp8" or recent > 0)
        assert outs["triton"] == outs["torch"], (fmt, recent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_ops_match_pytorch(dtype, monkeypatch):
    """RMSNorm, rotary embedding (in place, on strided slices of a fused qkv row) and SiLU-and-multiply: the Triton
    kernels give what the PyTorch forms of layers.py give (bf16: within one rounding step)."""
    from leapdecode.model import layers, triton_ops as ops
    from leapdecode.model.layers import RMSNorm, RotaryEmbedding, _rotate
    monkeypatch.setattr(layers, "FUSED_OPS", False)             # the modules below compute the PyTorch forms
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    tol = 0 if dtype == torch.float32 else 1e-2
    norm = RMSNorm(96, 1e-5).to(DEV, dtype)
    norm.weight.data = rnd(96)
    x = rnd(5, 96)
    want = norm(x)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), want, atol=tol or 2e-6, rtol=tol or 2e-6)
    rope = RotaryEmbedding(32, 64, 10000.0, None)
    rope.build(DEV)
    qkv = rnd(7, (4 + 2 + 2) * 32)
    q, k = qkv[:, :128].view(7, 4, 32), qkv[:, 128:192].view(7, 2, 32)
    pos = torch.tensor([0, 5, 9, 63, 1, 2, 40], device=DEV)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    wq, wk = _rotate(q, cos, sin), _rotate(k, cos, sin)
    v_before = qkv[:, 192:].clone()
    ops.rope_(pos, q, k, rope.cos, rope.sin)
    torch.testing.assert_close(q, wq, atol=tol or 2e-6, rtol=tol or 2e-6)
    torch.testing.assert_close(k, wk, atol=tol or 2e-6, rtol=tol or 2e-6)
    assert torch.equal(qkv[:, 192:], v_before)                  # the values are left alone
    gu = rnd(6, 2 * 80)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gu), torch.nn.functional.silu(gate) * up, atol=tol or 2e-6,
                               rtol=tol or 2e-6)


@pytest.mark.skipif(CUDA, reason="on a GPU the graphs themselves are captured and tested (TestOnGPU)")
def test_graph_buffers_and_padding_under_interpreter(tiny_dir):
    """The CUDA-graph path without a GPU: every decode and verification step goes through the graphs' static
    buffers, bucket padding (padding sequences and tokens) and graph attention plan, run eagerly; greedy tokens
    equal the torch backend's. Batches of 1..5 requests with n-gram drafts hit decode and verification buckets."""
    from leapdecode import LLM, SamplingParams
    from leapdecode.engine.cuda_graphs import CudaGraphs

    path = tiny_dir("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 40) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}   # verification steps for sure
    ref = LLM(path, dtype="float32", device="cpu", max_model_len=96, speculative_config=spec,
              attention_backend="torch")
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=96, speculative_config=spec,
              attention_backend="triton", pad_to_buckets=True)
    r = llm.engine.runner
    assert r.graphs is None                                      # CPU: nothing captured by default
    r.graphs = CudaGraphs(r.model, r.backend, r.device, r.block_size, r.max_model_len, None, 4, (1, 4),
                          capture_graphs=False)
    r.graphs.capture()
    assert set(r.graphs.graphs) == {(b, q) for b in (1, 2, 4) for q in (1, 4)}
    for n in (1, 3, 5):
        want = [o.outputs[0].token_ids for o in ref.generate(prompts[:n], params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], params, use_tqdm=False)]
        assert got == want
    assert r.graphs.num_replays > 0
    assert {q for _, q in r.graphs.used} == {1, 4} and {b for b, _ in r.graphs.used} >= {1, 4}


@pytest.mark.skipif(CUDA, reason="on a GPU the graphs themselves are captured and tested (TestOnGPU)")
@pytest.mark.parametrize("fmt,extra", [("int8", {}), ("int4", {}), ("fp8", {"kv_cache_recent_tokens": 16})])
def test_windowed_cache_graph_buffers_under_interpreter(tiny_dir, fmt, extra):
    """Windowed caches (int8, int4 with salient tokens, fp8 keeping recent tokens) through the CUDA graphs'
    static buffers without a GPU: window slots, window table and seal plans copied in, seals padded to the bucket
    (padding seals into the trash block), decode and verification buckets, steps that seal and steps that do not
    (int4; int8 and fp8 seal a decode step's blocks after the replay on the CPU); greedy tokens and every sealed
    block's codes equal the same cache's eager steps."""
    from leapdecode import LLM, SamplingParams
    from leapdecode.engine.cuda_graphs import CudaGraphs

    path = tiny_dir("llama")
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 40) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    kw = dict(dtype="float32", device="cpu", max_model_len=96, speculative_config=spec, attention_backend="triton",
              kv_cache_dtype=fmt, **extra)
    ref = LLM(path, **kw)
    llm = LLM(path, pad_to_buckets=True, **kw)
    r = llm.engine.runner
    assert r.trash_block == r.num_blocks and r.kv_cache.num_blocks == r.num_blocks + 1
    r.graphs = CudaGraphs(r.model, r.backend, r.device, r.block_size, r.max_model_len, None, 4, (1, 4),
                          capture_graphs=False, trash_block=r.trash_block)
    r.graphs.capture()
    assert set(r.graphs.sealing) == set(r.graphs.graphs)
    for n in (1, 3):
        want = [o.outputs[0].token_ids for o in ref.generate(prompts[:n], params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], params, use_tqdm=False)]
        assert got == want
        # the same steps in the same blocks: every sealed block holds the same codes (and what decodes them)
        for (name, mine, axis), (_, theirs, _) in zip(r.kv_cache.planes(), ref.engine.runner.kv_cache.planes()):
            assert torch.equal(mine.narrow(axis, 0, r.num_blocks), theirs.narrow(axis, 0, r.num_blocks)), name
    # (int8 and fp8: on the CPU a decode step's filled blocks seal after the replay, from the window)
    assert (r.graphs.num_sealing_replays > 0) == (fmt == "int4") and r.graphs.num_replays > r.graphs.num_sealing_replays
    assert {q for _, q in r.graphs.used} == {1, 4}


@pytest.mark.skipif(CUDA, reason="on a GPU the draft model's graphs are captured (TestOnGPU's draft-model test)")
def test_draft_model_graph_buffers_under_interpreter():
    """The draft model's CUDA-graph path without a GPU: its one-token forwards and short catch-ups go through its
    own graphs' static buffers and padding (run eagerly), and it drafts exactly what its eager forwards draft
    (same draft and accepted counts, same output)."""
    from leapdecode import LLM, SamplingParams
    from leapdecode.assets import default_draft_model_path, default_model_path

    prompts = ["def fibonacci(n):\n    ", "import os\nfor name in ", "class Stack:\n    def "]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"method": "draft_model", "model": default_draft_model_path(), "num_speculative_tokens": 3,
            "adaptive": False}
    runs = {}
    for graphs in (False, True):
        llm = LLM(default_model_path(), dtype="float32", device="cpu", max_model_len=128, attention_backend="triton",
                  kv_cache_memory="64MiB", speculative_config=spec)
        d = llm.engine.speculator.drafter
        assert d.graphs is None                                   # CPU: nothing captured by default
        if graphs:
            d.graphs = d.cuda_graphs(4, capture_graphs=False)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.engine.stats
        runs[graphs] = (outs, s["draft_tokens"], s["accepted_tokens"])
    assert runs[True] == runs[False] and runs[True][2] > 0, runs
    assert d.graphs.num_replays > 0 and (1, 1) in d.graphs.used, d.graphs.used
    # a catch-up of two tokens (a fully accepted draft's last token and the bonus) replays the (1, k + 1) bucket
    blocks = [d.free.pop() for _ in range(2)]
    d.forward([(0, list(range(5, 18)), blocks)])                 # 13 tokens: eager
    got = d.forward([(13, [18, 19], blocks)])
    assert (1, 4) in d.graphs.used
    d.graphs = None
    torch.testing.assert_close(got, d.forward([(13, [18, 19], blocks)]), atol=1e-5, rtol=1e-5)


def engine_tokens(tiny_dir, monkeypatch, arch, spec=None, n_prompts=12, max_tokens=48, max_len=200):
    from leapdecode import LLM, SamplingParams

    path = tiny_dir(arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(3, max_len))] for _ in range(n_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec_cfg = {"method": spec, "num_speculative_tokens": 3} if spec else None
    results = {}
    for name in ("torch", "triton"):
        llm = LLM(path, dtype="float32", device=DEV.type, max_model_len=512, max_num_batched_tokens=32 if not CUDA
                  else 256, speculative_config=spec_cfg, attention_backend=name)
        assert llm.engine.runner.backend.name == name
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return results


# -- compiled for a GPU without one ------------------------------------------------------------------------------
# The interpreter runs the kernels' Python, not the compiler: constructs that only fail when lowered (dot shapes,
# types, non-constexpr globals) would pass above. This builds the variants the launchers pick, down to an sm_90
# cubin with the ptxas shipped in the triton wheel, in a fresh process (no interpreter), capturing each launch.
AOT_SCRIPT = r"""
import sys, torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from leapdecode.attention import triton_kernels as tk
assert not tk.INTERPRETED
TY = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
      torch.int64: "*i64", torch.uint8: "*u8"}
launches = []
for kern in (tk._write_kv_kernel, tk._decode_partial_kernel, tk._decode_reduce_kernel, tk._prefill_kernel):
    kern.run = lambda *a, grid, warmup, _k=kern, **kw: launches.append((_k, a, kw))
def case(dtype, hkv, group, d):
    cache = torch.empty(2, 64, 16, hkv, d, dtype=dtype)
    q = torch.empty(8, hkv * group, d, dtype=dtype)
    bt, sl = torch.zeros(4, 4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    qsl, pos = torch.tensor([0, 1, 2, 3, 8], dtype=torch.int32), torch.zeros(8, dtype=torch.long)
    return q, cache, bt, sl, qsl, pos
q, cache, bt, sl, qsl, pos = case(torch.bfloat16, 8, 4, 128)
tk.write_kv_triton(q[:, :8], q[:, :8], cache, pos)
tk.paged_decode_attention(q, cache, bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=8)
tk.paged_prefill_attention(q, cache, bt, sl, qsl, pos, 0.1, max_query_len=5,
                           tree_mask=torch.ones(25, dtype=torch.uint8), tree_offsets=torch.zeros(4, dtype=torch.int32))
q, cache, bt, sl, qsl, pos = case(torch.float32, 2, 7, 64)
tk.paged_decode_attention(q, cache, bt, sl, qsl, pos, 0.1, max_seq_len=100, num_splits=1, sliding_window=64)
q, cache, bt, sl, qsl, pos = case(torch.float16, 2, 2, 64)
tk.paged_prefill_attention(q, cache, bt, sl, qsl, pos, 0.1, max_query_len=512, sliding_window=256)
q, cache, bt, sl, qsl, pos = case(torch.bfloat16, 8, 4, 128)            # fp8 codes with float16 scales
codes, scales = torch.empty(cache.shape, dtype=torch.uint8), torch.empty(cache.shape[:-1], dtype=torch.float16)
tk.write_kv_triton(codes[0, :8, 0], codes[1, :8, 0], codes, pos)
tk.write_kv_triton(scales[0, :8, 0, :, None], scales[1, :8, 0, :, None], scales[..., None], pos)
fp8 = tk.QuantizedKV("fp8", scales)
tk.paged_decode_attention(q, codes, bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=8, quant=fp8)
tk.paged_prefill_attention(q, codes, bt, sl, qsl, pos, 0.1, max_query_len=5, quant=fp8)
win = torch.empty(2, 8, 16, 8, 128, dtype=torch.bfloat16)                  # fp8 with recent tokens: a window
fp8w = tk.QuantizedKV("fp8", scales, window=win, table=bt)
tk.paged_decode_attention(q, codes, bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=8, quant=fp8w)
tk.paged_prefill_attention(q, codes, bt, sl, qsl, pos, 0.1, max_query_len=5, quant=fp8w)
grids = dict(key_grid=torch.empty(64, 2, 8, 128, dtype=torch.float16),     # int8 and int4 (2 salient tokens)
             value_grid=torch.empty(64, 2, 16, 8, dtype=torch.float16), window=win, table=bt)
tk.paged_decode_attention(q, codes, bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=8,
                          quant=tk.QuantizedKV("int8", **grids))
int4 = tk.QuantizedKV("int4", **grids, salient=torch.empty(64, 2, 8, dtype=torch.uint8),
                      residual=torch.empty(2, 64, 2, 8, 64, dtype=torch.uint8))
tk.paged_decode_attention(q, codes[..., :64], bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=1, quant=int4)
tk.paged_prefill_attention(q, codes[..., :64], bt, sl, qsl, pos, 0.1, max_query_len=5, quant=int4)
per_block = dict(grid_per_block=True)                                     # keys' grids once per block
tk.paged_decode_attention(q, codes, bt, sl, qsl, pos, 0.1, max_seq_len=4000, num_splits=8,
                          quant=tk.QuantizedKV("int8", **grids), tune=per_block)
tk.paged_prefill_attention(q, codes[..., :64], bt, sl, qsl, pos, 0.1, max_query_len=5, quant=int4, tune=per_block)
for kern, args, kw in launches:
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    sig, const = {}, {}
    for name, a in zip(kern.arg_names, list(args) + [kw.get(n) for n in kern.arg_names[len(args):]]):
        if name in kw:
            sig[name], const[name] = "constexpr", kw[name]
        elif isinstance(a, torch.Tensor):
            sig[name] = TY[a.dtype]
        else:
            sig[name] = "fp32" if isinstance(a, float) else "i32"
    c = triton.compile(ASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
    assert c.asm.get("cubin"), kern.__name__
    print("compiled", kern.__name__, flush=True)
"""


@pytest.mark.skipif(CUDA, reason="with CUDA the GPU tests compile and run the kernels for real")
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and ("ImportError" in r.stderr or "TypeError" in r.stderr) and "compiled" not in r.stdout:
        pytest.skip(f"this triton's AOT compile API differs: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == 21


# -- on a GPU, compiled, at real sizes -------------------------------------------------------------------------
@cuda_only
class TestOnGPU:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("hkv,group,d", [(8, 4, 128), (2, 7, 64), (8, 1, 64), (1, 8, 128)])
    def test_decode_long_ragged(self, dtype, hkv, group, d):
        ctx = [4000, 17, 1023, 2500, 0, 300]
        q, kv, meta = make_case(10, ctx, [1] * len(ctx), hkv, group, d, 16, dtype)
        for splits in (None, 1, 7):
            check(run_decode(q, kv, meta, d ** -0.5, num_splits=splits), reference(q, kv, meta, d ** -0.5), dtype)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("window", [None, 256])
    def test_prefill_verify_trees(self, dtype, window):
        ctx, qlen = [0, 900, 64, 1500, 33], [700, 5, 3, 1, 130]
        q, kv, meta = make_case(11, ctx, qlen, 8, 4, 128, 32, dtype, window, trees=(1, 2))
        check(run_prefill(q, kv, meta, 128 ** -0.5), reference(q, kv, meta, 128 ** -0.5), dtype)

    def test_decode_window(self):
        q, kv, meta = make_case(12, [3000, 100, 999], [1, 1, 1], 8, 4, 128, 16, torch.bfloat16, window=512)
        check(run_decode(q, kv, meta, 0.09), reference(q, kv, meta, 0.09), torch.bfloat16)

    @pytest.mark.parametrize("arch,spec", [("llama", None), ("mistral", None), ("llama", "ngram"),
                                           ("qwen3", "suffix")])
    def test_engine_greedy_equals_torch_backend(self, tiny_dir, monkeypatch, arch, spec):
        out = engine_tokens(tiny_dir, monkeypatch, arch, spec)
        assert out["triton"] == out["torch"]

    def test_graph_replay_equals_eager_for_every_bucket(self, tiny_dir):
        """Greedy tokens with CUDA graphs (decode and verification buckets 1..16) equal the same engine with
        ``enforce_eager``, for batches that land in every bucket (and pad most of them)."""
        from leapdecode import LLM, SamplingParams
        path = tiny_dir("llama")
        rng = random.Random(5)
        prompts = [[rng.randrange(2, 40) for _ in range(rng.randint(3, 60))] for _ in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        spec = {"method": "ngram", "num_speculative_tokens": 3}
        kw = dict(dtype="float32", device="cuda", max_model_len=256, attention_backend="triton",
                  max_num_seqs=16, speculative_config=spec)
        eager, graphs = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
        g = graphs.engine.runner.graphs
        assert eager.engine.runner.graphs is None and g is not None
        assert set(g.graphs) == {(b, q) for b in (1, 2, 4, 8, 16) for q in (1, 4)}
        for n in (1, 2, 3, 5, 8, 11, 16):
            want = [o.outputs[0].token_ids for o in eager.generate(prompts[:n], params, use_tqdm=False)]
            assert [o.outputs[0].token_ids for o in graphs.generate(prompts[:n], params, use_tqdm=False)] == want
        assert {b for b, _ in g.used} == {1, 2, 4, 8, 16} and {q for _, q in g.used} == {1, 4}

    @pytest.mark.parametrize("fmt,extra", [("int8", {}), ("int4", {}), ("fp8", {"kv_cache_recent_tokens": 16})])
    def test_windowed_cache_graphs_equal_eager(self, tiny_dir, fmt, extra):
        """Windowed caches captured in CUDA graphs (each bucket with its sealing twin) give the greedy tokens of
        the same engine with ``enforce_eager``, and leave the same codes in every sealed block. (int4's codes are
        not compared: its salient tokens are ranked by a batched matmul over the step's seals, padded in a graph,
        whose last bits may move with the batch and flip a near-tie.)"""
        from leapdecode import LLM, SamplingParams
        path = tiny_dir("llama")
        rng = random.Random(6)
        prompts = [[rng.randrange(2, 40) for _ in range(rng.randint(3, 60))] for _ in range(8)]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        kw = dict(dtype="float32", device="cuda", max_model_len=256, attention_backend="triton", max_num_seqs=8,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                  kv_cache_dtype=fmt, num_kv_blocks=160, **extra)
        eager, graphs = LLM(path, enforce_eager=True, **kw), LLM(path, **kw)
        g = graphs.engine.runner.graphs
        assert g is not None and set(g.sealing) == set(g.graphs)
        for n in (1, 3, 8):
            want = [o.outputs[0].token_ids for o in eager.generate(prompts[:n], params, use_tqdm=False)]
            assert [o.outputs[0].token_ids for o in graphs.generate(prompts[:n], params, use_tqdm=False)] == want
            r, e = graphs.engine.runner, eager.engine.runner
            for (name, mine, axis), (_, theirs, _) in zip(r.kv_cache.planes() if fmt != "int4" else (),
                                                          e.kv_cache.planes()):
                assert torch.equal(mine.narrow(axis, 0, r.num_blocks), theirs.narrow(axis, 0, r.num_blocks)), name
        assert g.num_sealing_replays > 0 and g.num_replays > g.num_sealing_replays

    def test_graphs_and_overlap_equal_the_cpu_reference(self, tiny_dir):
        """The engine on CUDA with graphs and the overlapped step (async scheduling) gives the greedy tokens of
        the CPU reference engine (torch backend, eager, synchronous), float32."""
        from leapdecode import LLM, SamplingParams
        path = tiny_dir("llama")
        rng = random.Random(6)
        prompts = [[rng.randrange(2, 384) for _ in range(rng.randint(3, 100))] for _ in range(9)]
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        cpu = LLM(path, dtype="float32", device="cpu", max_model_len=256, attention_backend="torch")
        gpu = LLM(path, dtype="float32", device="cuda", max_model_len=256, attention_backend="triton",
                  async_scheduling=True)
        want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == want
        assert gpu.engine.runner.graphs.num_replays > 0 and gpu.engine.stats["overlapped_steps"] > 0

    def test_draft_model_speculation_on_cuda(self):
        """Draft-model speculation on CUDA (the embedded model and its draft model, float32, graphs on, the draft
        model's too): the draft model's logits equal its logits on the CPU, its drafts are accepted, and the output
        is plain decoding's."""
        from leapdecode import LLM, SamplingParams
        from leapdecode.assets import default_draft_model_path, default_model_path
        from leapdecode.spec.draft_model import DraftModelDrafter
        logits = {}
        for dev in ("cpu", "cuda"):
            llm = LLM(default_model_path(), dtype="float32", device=dev, kv_cache_memory="256MiB",
                      attention_backend="torch" if dev == "cpu" else "triton")
            d = DraftModelDrafter(llm.engine.runner, default_draft_model_path(), 4)
            blocks = [d.free.pop() for _ in range(4)]
            logits[dev] = [d.forward([(0, list(range(5, 40)), blocks)]).cpu(),
                           d.forward([(35, [7], blocks)]).cpu()]
        for a, b in zip(logits["cpu"], logits["cuda"]):
            torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
        spec = {"method": "draft_model", "model": default_draft_model_path(), "num_speculative_tokens": 4,
                "adaptive": False}
        prompts = ["def fibonacci(n):\n    ", "import os\nfor name in ", "class Stack:\n    def "]
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outs = {}
        for label, cfg in (("plain", None), ("spec", spec)):
            llm = LLM(default_model_path(), dtype="float32", device="cuda", attention_backend="triton",
                      kv_cache_memory="256MiB", speculative_config=cfg)
            outs[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = dict(llm.engine.stats)
        assert outs["spec"] == outs["plain"]
        assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > stats["draft_tokens"] // 10, stats
        assert llm.engine.speculator.drafter.graphs.num_replays > 0      # the draft model's own CUDA graphs

    def test_adaptive_speculation_prices_graph_buckets(self):
        """With graphs on, the controller's step times are kept per graph bucket: every captured bucket has its
        replay time as a prior, the decode and verification buckets the engine replayed have real times, graph
        steps stay out of the token-count curve, and the output is plain decoding's."""
        from leapdecode import LLM, SamplingParams
        from leapdecode.assets import default_model_path
        # prompts whose greedy continuations the embedded model makes loops (prompt lookup accepts 72/76 and 75/75
        # of its drafts on the CPU): whether drafting pays must not hang on the machine. (On two H200s, with a
        # Fibonacci function and a print loop, 64 tokens at batch 2 never paid for a (2, 5) verification.)
        prompts = ["x = [" + "0, " * 24, "a = 1\nb = 2\n" * 6]
        params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
        outs = {}
        for label, cfg in (("plain", None), ("spec", {"method": "ngram", "num_speculative_tokens": 4})):
            llm = LLM(default_model_path(), dtype="float32", device="cuda", attention_backend="triton",
                      kv_cache_memory="256MiB", speculative_config=cfg, max_num_seqs=2)
            if cfg is not None:   # the controller's prices are under test: the guard's veto (which measured the
                llm.engine.speculator.guard = None   # embedded model's batch 2 as faster plain) would hide them
            outs[label] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            eng = llm.engine
        assert outs["spec"] == outs["plain"]
        st, graphs = eng.speculator.controller.step_time, eng.runner.graphs
        assert set(st.graphs._prior) == set(graphs.graphs)
        assert all(0 < t < 0.1 for t in st.graphs._prior.values())
        assert st.graphs.last_seen((2, 1)) is not None and st.graphs.last_seen((2, 5)) is not None
        assert eng.stats["accepted_tokens"] > 0
        assert eng.speculator.controller.graph_bucket(2, 3) == (2, 5)

    def test_triton_backend_on_cuda_by_name_and_opt_in(self, monkeypatch):
        from leapdecode.attention.backend import get_backend
        assert get_backend("triton", torch.device("cuda")).name == "triton"
        assert get_backend("auto", torch.device("cuda")).name == "triton"
        assert get_backend("auto", torch.device("cpu")).name == "torch"
        monkeypatch.setenv("LEAPDECODE_ATTENTION_BACKEND", "torch")
        assert get_backend("auto", torch.device("cuda")).name == "torch"
