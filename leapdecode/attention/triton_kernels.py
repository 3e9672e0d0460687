"""Triton kernels for attention over the paged KV cache, and the Python launchers that size their grids.

Three concepts, one kernel each (plus the split-KV reduction):

* ``write_kv_triton``: store this step's keys/values at their flat slots (negative slot = padding, stored nowhere).
* ``paged_decode_attention``: one query token per sequence. Decode reads every key of the sequence once and does
  little arithmetic per byte, so it is bound by memory bandwidth; what matters is keeping every SM streaming KV. At
  batch 1 a grid of (sequence, kv head) programs would occupy a handful of SMs, so each sequence's key range is cut
  into ``num_splits`` slices handled by separate programs (flash-decoding / LeanAttention's split-KV idea). Each
  slice writes a partial softmax state (its normalised output and log-sum-exp); a second small kernel merges the
  slices. All query heads that share a kv head are handled by the same program, so K/V bytes are read once per
  kv head (GQA/MQA), and the group is padded to 16 rows so the product runs on tensor cores.
* ``paged_prefill_attention``: a few to many query tokens per sequence (prefill chunks, speculative verification
  rows). A program takes a tile of (query token, head in group) rows of one sequence and one kv head and streams
  the keys it can see, flash-attention style.

Visibility is the rule of the reference backend (``torch_ref``): sequence i has ``seq_lens[i]`` keys after this step;
the last ``q_len`` of them are this step's tokens and carry the queries' own positions, the earlier ones (context)
sit at their index. A query at position p sees context keys at positions <= p and, among this step's keys, those at
positions <= p; or, when the sequence has a token-tree mask, exactly the ones the mask allows (its ancestors and
itself). A sliding window W further hides keys at positions <= p - W.

Numerics: products and the online softmax run in float32 (``exp2`` with the scale folded into log2 units); K/V stay
in the cache dtype (fp16, bf16 or fp32). For fp32 caches the dot products use IEEE fp32 rather than TF32 so an fp32
engine computes what the reference computes.

Pointers to the cache are computed in int64: block id x block stride overflows int32 on large caches.
The kernels also run under ``TRITON_INTERPRET=1`` on CPU (tests), where launch options are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# A decode slice should stream at least this many keys: below it the partial state and the merge cost more than
# the extra parallelism buys.
MIN_KEYS_PER_SPLIT = 128
# Upper bound on slices per sequence (bounds the float32 scratch for partial outputs).
MAX_SPLITS = 64
# Aim for this many decode programs per SM, so several are resident per SM and hide memory latency.
PROGRAMS_PER_SM = 4
# SM count assumed when there is no CUDA device (interpreter runs): small, so tests exercise splitting.
_FALLBACK_SMS = 4

# Finite "minus infinity" for running maxima: exp2(-inf - _NEG_BIG) == 0 and never NaN, even for rows that see no
# key in a tile. (A constexpr: jitted code may only read constexpr globals.)
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation. ``UPCAST`` works around the CPU interpreter, whose dot multiplies bfloat16
    operands as their raw uint16 bits (seen in triton 3.9): bf16 -> fp32 is exact, and fp32 products summed in fp32 are what
    a bf16 tensor-core MMA computes, so the emulation keeps the GPU's numerics."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# What a pool block holds (``QUANT``): the model's dtype, fp8 codes with per-token scales, or int8 / int4 codes on
# KIVI's grids (keys per channel over a block, values per token; int4 with salient tokens at 8 bits), see kv_quant.py.
AUTO, FP8, INT8, INT4 = 0, 1, 2, 3


@triton.jit
def _kv_tile(k_cache, v_cache, k_aux, v_aux, sal, k_res, v_res, k_win, v_win, kv_window, bt_row, b, g, j, jmask,
             d, dmask, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
             stride_wb, stride_ws, stride_wh, stride_wd, stride_kw, like,
             BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
             NSAL: tl.constexpr, NSAL_P2: tl.constexpr, WINDOWED: tl.constexpr, CODE_BYTES: tl.constexpr,
             GRID_BLOCKS: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of kv head g at the sequence's key indices j, through its block table
    row: from the pool (dequantized as the format says), or for a windowed cache, where the step's ``kv_window``
    names a window block (open and recent blocks), from the full-precision window."""
    page = tl.load(bt_row + j // BLOCK_SIZE, mask=jmask, other=0).to(tl.int64)
    o = j % BLOCK_SIZE
    kv_off = page * stride_cb + o * stride_cs + g * stride_ch
    s_off = page * stride_sb + o * stride_ss + g * stride_sh
    if WINDOWED:
        wb = tl.load(kv_window + b.to(tl.int64) * stride_kw + j // BLOCK_SIZE, mask=jmask, other=-1)
        in_win = wb >= 0
        w_off = tl.maximum(wb, 0).to(tl.int64) * stride_wb + o * stride_ws + g * stride_wh
    else:
        in_win = j < 0
        w_off = kv_off
    rows = jmask & ~in_win                              # keys read from the pool
    k = _load_kv(k_cache, k_aux, sal, k_res, k_win, kv_off, s_off, w_off, page, o, g, in_win, rows, d, dmask,
                 stride_cd, stride_wd, like, True, BLOCK_SIZE, HKV, HEAD_DIM, QUANT, NSAL, NSAL_P2, WINDOWED,
                 CODE_BYTES, GRID_BLOCKS)
    v = _load_kv(v_cache, v_aux, sal, v_res, v_win, kv_off, s_off, w_off, page, o, g, in_win, rows, d, dmask,
                 stride_cd, stride_wd, like, False, BLOCK_SIZE, HKV, HEAD_DIM, QUANT, NSAL, NSAL_P2, WINDOWED,
                 CODE_BYTES, GRID_BLOCKS)
    return k, v


@triton.jit
def _load_kv(cache, aux, sal, res, win, kv_off, s_off, w_off, page, o, g, in_win, rows, d, dmask, stride_cd,
             stride_wd, like, IS_KEY: tl.constexpr, BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr,
             HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, NSAL: tl.constexpr, NSAL_P2: tl.constexpr,
             WINDOWED: tl.constexpr, CODE_BYTES: tl.constexpr, GRID_BLOCKS: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of keys (``IS_KEY``) or values in the dtype of the pointer ``like`` (the
    queries'), decoded as ``kv_quant`` decodes, in float32 and rounded once to the model's dtype: fp8 = code *
    per-token scale (``aux``: the scales); int8/int4 = zero + step * unit, on the keys' per-channel or the values'
    per-token grid (``aux``: the grid, [blocks, 2 (zero, step), ...]); an int4 unit is 17 * nibble, or for a
    salient token (``sal``: each block's offsets per head) 16 * nibble + its low nibble (``res``). A windowed cache
    reads open and recent blocks from its full-precision window instead (``in_win``)."""
    pool = rows[:, None] & dmask[None, :]
    u = _code_tile(cache, kv_off, rows, d, dmask, stride_cd, HEAD_DIM, QUANT, CODE_BYTES)
    if QUANT == 3:
        nib = u
        u = nib * 17
        if NSAL > 0:
            is_sal, idx = _salient_row(sal, page, o, g, rows, HKV, NSAL, NSAL_P2)
            low = _code_tile(res, ((page * NSAL + idx) * HKV + g) * (HEAD_DIM // (2 * CODE_BYTES)), rows & is_sal, d,
                             dmask, 1, HEAD_DIM, QUANT, CODE_BYTES)
            u = tl.where(is_sal[:, None], nib * 16 + low, u)
    if QUANT == 1:
        sc = tl.load(aux + s_off, mask=rows, other=0.0).to(tl.float32)
        x = u.to(tl.float32) * sc[:, None]
    elif QUANT >= 2:
        u = u.to(tl.float32)
        if IS_KEY and GRID_BLOCKS:                       # the tile is whole blocks: each block's grid loaded once
            nb: tl.constexpr = page.shape[0] // BLOCK_SIZE
            pb = tl.max(tl.reshape(page, [nb, BLOCK_SIZE]), axis=1)      # (masked keys read page 0: max skips it)
            at = ((pb * 2) * HKV + g)[:, None] * HEAD_DIM + d[None, :]
            z = tl.load(aux + at, mask=dmask[None, :], other=0.0).to(tl.float32)
            st = tl.load(aux + at + HKV * HEAD_DIM, mask=dmask[None, :], other=0.0).to(tl.float32)
            z = tl.reshape(tl.broadcast_to(z[:, None, :], [nb, BLOCK_SIZE, d.shape[0]]),
                           [page.shape[0], d.shape[0]])
            st = tl.reshape(tl.broadcast_to(st[:, None, :], [nb, BLOCK_SIZE, d.shape[0]]),
                            [page.shape[0], d.shape[0]])
        elif IS_KEY:                                     # [blocks, 2, HKV, HEAD_DIM]: per channel, per key
            at = ((page * 2) * HKV + g)[:, None] * HEAD_DIM + d[None, :]
            z = tl.load(aux + at, mask=pool, other=0.0).to(tl.float32)
            st = tl.load(aux + at + HKV * HEAD_DIM, mask=pool, other=0.0).to(tl.float32)
        else:                                            # [blocks, 2, BLOCK_SIZE, HKV]: per token
            at = ((page * 2) * BLOCK_SIZE + o) * HKV + g
            z = tl.load(aux + at, mask=rows, other=0.0).to(tl.float32)[:, None]
            st = tl.load(aux + at + BLOCK_SIZE * HKV, mask=rows, other=0.0).to(tl.float32)[:, None]
        x = z + st * u
    else:
        x = u
    x = x.to(like.dtype.element_ty)
    if WINDOWED:
        xw = tl.load(win + w_off[:, None] + d[None, :] * stride_wd, mask=in_win[:, None] & dmask[None, :],
                     other=0.0)
        x = tl.where(in_win[:, None], xw.to(like.dtype.element_ty), x)
    return x


@triton.jit
def _code_tile(ptr, row_off, rows, d, dmask, stride_cd, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
               CODE_BYTES: tl.constexpr):
    """The codes of a [rows, BLOCK_D] tile whose rows start at ``row_off`` (in the pointer's elements): fp8 as
    e4m3 numbers, int8 as 0-255, int4 as nibbles (int32). Read CODE_BYTES bytes a load and unpacked in registers
    (``_unpack_codes``, ``_code_views``), or a byte at a time (int4: two channels a byte, even channel low)."""
    if CODE_BYTES > 1:
        per: tl.constexpr = CODE_BYTES * (2 if QUANT == 3 else 1)          # codes a word
        w = tl.arange(0, d.shape[0] // per)
        word = tl.load(ptr + row_off[:, None] + w[None, :], mask=rows[:, None] & (w[None, :] * per < HEAD_DIM),
                       other=0)
        x = tl.reshape(_unpack_codes(word, QUANT, CODE_BYTES), [word.shape[0], d.shape[0]])
    elif QUANT == 3:
        byte = tl.load(ptr + row_off[:, None] + (d[None, :] // 2) * stride_cd, mask=rows[:, None] & dmask[None, :],
                       other=0).to(tl.int32)
        x = (byte >> ((d[None, :] % 2) * 4)) & 15
    else:
        x = tl.load(ptr + row_off[:, None] + d[None, :] * stride_cd, mask=rows[:, None] & dmask[None, :], other=0)
        if QUANT == 1:
            x = x.to(tl.float8e4nv, bitcast=True)
    return x


@triton.jit
def _salient_row(sal, page, o, g, rows, HKV: tl.constexpr, NSAL: tl.constexpr, NSAL_P2: tl.constexpr):
    """int4: (is each key of the tile one of its block's salient tokens, its index among them)."""
    i = tl.arange(0, NSAL_P2)
    offs = tl.load(sal + (page[:, None] * NSAL + i[None, :]) * HKV + g,
                   mask=rows[:, None] & (i[None, :] < NSAL), other=255).to(tl.int32)
    match = (offs == o[:, None]).to(tl.int32)                       # [BLOCK_N, NSAL_P2]
    return tl.max(match, axis=1) > 0, tl.argmax(match, axis=1).to(tl.int64)


@triton.jit
def _code(word, k: tl.constexpr, QUANT: tl.constexpr):
    """Code k of each word: fp8 as its e4m3 number and int8 as 0-255 (float32, bytes), int4 as 0-15 (int32,
    nibbles; a byte's low nibble first)."""
    if QUANT == 3:
        x = ((word >> (4 * k)) & 15).to(tl.int32)
    else:
        b = ((word >> (8 * k)) & 255).to(tl.uint8)
        if QUANT == 1:
            b = b.to(tl.float8e4nv, bitcast=True)
        x = b.to(tl.float32)
    return x


@triton.jit
def _codes2(word, s: tl.constexpr, st: tl.constexpr, QUANT: tl.constexpr):
    return tl.join(_code(word, s, QUANT), _code(word, s + st, QUANT))


@triton.jit
def _codes4(word, s: tl.constexpr, st: tl.constexpr, QUANT: tl.constexpr):
    return tl.join(_codes2(word, s, 2 * st, QUANT), _codes2(word, s + st, 2 * st, QUANT))


@triton.jit
def _codes8(word, s: tl.constexpr, st: tl.constexpr, QUANT: tl.constexpr):
    return tl.join(_codes4(word, s, 2 * st, QUANT), _codes4(word, s + st, 2 * st, QUANT))


@triton.jit
def _codes16(word, s: tl.constexpr, st: tl.constexpr, QUANT: tl.constexpr):
    return tl.join(_codes8(word, s, 2 * st, QUANT), _codes8(word, s + st, 2 * st, QUANT))


@triton.jit
def _unpack_codes(word, QUANT: tl.constexpr, CODE_BYTES: tl.constexpr):
    """[..., n] little-endian words of CODE_BYTES bytes -> [..., n, c] codes (c = CODE_BYTES bytes, or twice as
    many nibbles for int4), code k of a word at k: ``_codesN(word, s, st)`` holds codes s, s + st, s + 2 st, ...,
    the last join's axis innermost, so code k lands at k once the axes are flattened. Why words: loaded a byte at a
    time, the values' tile reached the matrix units through shared memory one byte a load (no transposing
    ldmatrix reads 8-bit elements), and the fp8 kernel ran at 0.6-0.7x of bf16's speed on an H200 while reading
    half the bytes."""
    n: tl.constexpr = CODE_BYTES * (2 if QUANT == 3 else 1)
    if n == 2:
        x = _codes2(word, 0, 1, QUANT)
    elif n == 4:
        x = _codes4(word, 0, 1, QUANT)
    elif n == 8:
        x = _codes8(word, 0, 1, QUANT)
    else:
        x = _codes16(word, 0, 1, QUANT)
    return x


# ---------------------------------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copy all its kv heads to (block, offset) of its slot; a negative slot is padding."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # (the slot test is made a vector first: the CPU interpreter rejects masks mixing a scalar bool in)
    valid = tl.zeros([BLOCK_H], tl.int64) + slot >= 0
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & valid[:, None]
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :] * stride_cd
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T] (negative: skip)."""
    T, hkv, d = k.shape
    if T == 0:
        return
    _, _, block_size, chk, chd = kv_cache.shape
    if (chk, chd) != (hkv, d) or v.shape != k.shape or slot_mapping.shape[0] != T:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} "
                         f"do not fit the cache {tuple(kv_cache.shape)}")
    kc, vc = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(T,)](
        k, v, kc, vc, slot_mapping,
        *k.stride(), *v.stride(), *kc.stride(),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), num_warps=4)


# ---------------------------------------------------------------------------------------------------------------
# Decode: split-KV partial pass + merge
# ---------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_splits"])       # (it changes with the context length: no recompiles)
def _decode_partial_kernel(
    q_ptr, k_cache, v_cache, k_aux, v_aux, sal, k_res, v_res, k_win, v_win, kv_window,
    block_tables, seq_lens, query_start_loc, positions, seq_ids,
    out_ptr, mid_o, mid_lse,
    scale_log2, window, num_splits,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    stride_wb, stride_ws, stride_wh, stride_wd, stride_kw, stride_bt,
    stride_mb, stride_mh, stride_ms, stride_md, stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HKV: tl.constexpr, QUANT: tl.constexpr, NSAL: tl.constexpr, NSAL_P2: tl.constexpr, WINDOWED: tl.constexpr,
    CODE_BYTES: tl.constexpr, GRID_BLOCKS: tl.constexpr,
):
    """Program (i, kv head g, slice s): the query heads of group g of decode row i against keys of slice s.

    Keys [lo, seq_len) are cut into ``num_splits`` equal slices (rounded to BLOCK_N); a short sequence leaves its
    trailing slices empty, which then report lse = -inf and weigh nothing in the merge. With one slice the output
    is normalised and written directly (no merge kernel)."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    b = tl.load(seq_ids + i)
    seq_len = tl.load(seq_lens + b)
    row = tl.load(query_start_loc + b)
    p = tl.load(positions + row)
    ctx = seq_len - 1                                   # keys before this step's token sit at their index
    lo = 0
    if HAS_WINDOW:                                      # context keys at or below p - window are not visible
        lo = tl.maximum(tl.minimum(p - window + 1, ctx), 0).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + s * per_split
    end = tl.minimum(start + per_split, seq_len)

    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = hh < GROUP
    dmask = d < HEAD_DIM
    heads = g * GROUP + hh
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=hmask[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jmask = j < end
        k, v = _kv_tile(k_cache, v_cache, k_aux, v_aux, sal, k_res, v_res, k_win, v_win, kv_window, bt_row, b, g, j,
                        jmask, d, dmask, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
                        stride_wb, stride_ws, stride_wh, stride_wd, stride_kw, q_ptr,
                        BLOCK_SIZE, HKV, HEAD_DIM, QUANT, NSAL, NSAL_P2, WINDOWED, CODE_BYTES, GRID_BLOCKS)
        qk = _mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2       # [BLOCK_H, BLOCK_N]
        visible = jmask & ((j <= p) | (j == ctx))       # (the window is applied by starting at lo)
        qk = tl.where(visible[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _mma(pr.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_o + i * stride_mb + heads[:, None] * stride_mh + s * stride_ms + d[None, :] * stride_md,
                 o, mask=omask)
        tl.store(mid_lse + i * stride_lb + heads * stride_lh + s * stride_ls, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    mid_o, mid_lse, out_ptr, query_start_loc, seq_ids, num_splits,
    stride_mb, stride_mh, stride_ms, stride_md, stride_lb, stride_lh, stride_ls,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (i, head): merge the slices' (output, lse) pairs: weights 2^(lse_s - max lse), normalised."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(query_start_loc + tl.load(seq_ids + i))
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    lse = tl.load(mid_lse + i * stride_lb + h * stride_lh + sp * stride_ls, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)                     # finite: the slice holding the query's own key is never empty
    w = tl.exp2(lse - m)
    o = tl.load(mid_o + i * stride_mb + h * stride_mh + sp[:, None] * stride_ms + d[None, :] * stride_md,
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d * stride_od, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# Whether this module's kernels were defined under TRITON_INTERPRET=1 (decided once, when triton.jit ran).
INTERPRETED = type(_write_kv_kernel).__name__ == "InterpretedFunction"


def decode_tuning(dtype: torch.dtype, head_dim: int) -> dict:
    """Tile and launch shape of the decode kernel. 16-bit caches: 64 keys per tile, 4 warps, 2 stages, the best
    of the 27 (block_n, num_warps, num_stages) variants timed on an H200 at batch 1 x 32k keys, Llama-3-8B heads
    (53.7 us, 0.93x cuDNN SDPA on dense K/V; the earlier 32 / 8 / 2 took 80.6 us; 8 warps were the slowest at every
    tile size). fp32 caches keep 32-key tiles and 8 warps (64-row fp32 tiles spill on sm_90; not timed).
    ``benchmarks/decode_roofline.py --tune`` times the alternatives."""
    if dtype == torch.float32:
        return dict(block_n=32, num_warps=8, num_stages=2)
    return dict(block_n=64, num_warps=4, num_stages=2)


def prefill_tuning(dtype: torch.dtype, head_dim: int, rows: int) -> dict:
    """Tile and launch shape of the prefill kernel; ``rows`` = longest query run x heads per kv head. Short runs
    (verification) get a small query tile, so a tile is not mostly padding. Chosen like ``decode_tuning``: no
    register spills on sm_90 (fp32 tiles stay at 32 rows: 64-row fp32 tiles spill heavily)."""
    half = dtype != torch.float32
    block_m = 16 if rows <= 16 else 32 if rows <= 32 or not half else 64
    return dict(block_m=block_m, block_n=32, num_warps=4 if half and head_dim <= 64 else 8, num_stages=2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_SMS


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Slices per sequence: enough programs for ``PROGRAMS_PER_SM`` per SM, but each slice keeps at least
    ``MIN_KEYS_PER_SPLIT`` keys of the longest sequence, and never more than ``MAX_SPLITS``. Large batches already
    fill the GPU with (sequence, kv head) programs and get one slice (no merge pass)."""
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    useful = triton.cdiv(max(1, max_seq_len), MIN_KEYS_PER_SPLIT)
    return max(1, min(want, useful, MAX_SPLITS))


@dataclass(frozen=True)
class QuantizedKV:
    """What the kernels read beside a quantized cache's codes (the same tensors ``kv_cache``'s layer views hold):
    ``fmt`` "fp8" with ``scales`` [2, blocks, bs, Hkv] float16, or "int8"/"int4" with ``key_grid`` [blocks, 2,
    Hkv, D] and ``value_grid`` [blocks, 2, bs, Hkv] (float16 zero, step), and int4's ``salient`` offsets [blocks,
    n, Hkv] with their low nibbles ``residual`` [2, blocks, n, Hkv, D / 2]; a windowed cache also its full-precision
    ``window`` [2, W, bs, Hkv, D] and the step's ``table`` [B, >= blocks per table] (int32: the window block of each
    table entry, -1 where the pool holds it)."""
    fmt: str = "auto"
    scales: torch.Tensor | None = None
    key_grid: torch.Tensor | None = None
    value_grid: torch.Tensor | None = None
    salient: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    window: torch.Tensor | None = None
    table: torch.Tensor | None = None


_QUANT = {"auto": AUTO, "fp8": FP8, "int8": INT8, "int4": INT4}


def default_code_bytes(head_dim: int) -> int:
    """Bytes of quantized codes a load in the attention kernels (1, 2, 4 or 8; see ``_unpack_codes``), measured
    on an H200 (benchmarks/README.md): at head_dim 128 eight a load made the decode kernel 1.15-1.27x faster for
    fp8, 1.14-1.30x for int8 and 1.8-2.3x for int4 with salient tokens (batch 1-64, 4k-32k keys; equal at 1 x 4k,
    where launches dominate); at head_dim 64 (Llama-3.2-1B, batch 64/256, 2k keys) the engine's fp8 decode went
    from 0.92x to 0.76x of bf16's with them, so smaller heads read bytes. So does the CPU interpreter (its joins
    made engine tests 3-8x slower; a test reads words)."""
    return 8 if head_dim >= 128 and not INTERPRETED else 1


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

GRID_PER_BLOCK = False
"""int8/int4 keys: load each block's per-channel grid once per tile and broadcast it (``tune["grid_per_block"]``)
where a tile's keys are whole blocks, instead of once per key. The same values bit for bit; off by default until
timed on a GPU: per key, the grid tiles (4 bytes a key and channel) took ~64 KB of the int8 decode kernel's ~86 KB
of shared memory in the sm_90 build (2 blocks of 128 threads an SM)."""


def _code_views(kv_cache: torch.Tensor, quant: "QuantizedKV | None", code_bytes: int, pointers: tuple
                ) -> tuple[torch.Tensor, torch.Tensor, int, tuple]:
    """(keys' pool, values' pool, bytes a load, ``_quant_args``' pointers) as the kernels read them: quantized
    codes (and int4's salient low nibbles) as words of ``code_bytes`` bytes where a head's bytes divide into
    them, anything else as it is."""
    k, v = kv_cache[0], kv_cache[1]
    if code_bytes not in _WORD:
        raise ValueError(f"code_bytes must be one of {sorted(_WORD)}, got {code_bytes!r}")
    if quant is None or quant.fmt == "auto" or code_bytes == 1 or k.shape[-1] % code_bytes or k.stride(-1) != 1:
        return k, v, 1, pointers
    word = _WORD[code_bytes]
    try:                                     # (a view whose strides or offset do not fall on words fails here)
        res = pointers[3:5] if pointers[3] is kv_cache else (pointers[3].view(word), pointers[4].view(word))
        return k.view(word), v.view(word), code_bytes, (*pointers[:3], *res, *pointers[5:])
    except RuntimeError:                     # (int4's salient low nibbles are laid out like the codes)
        return k, v, 1, pointers


def _quant_args(kv_cache: torch.Tensor, quant: QuantizedKV | None, block_tables: torch.Tensor, head_dim: int):
    """(pointer arguments, scale strides, window strides, constexprs) of a cache for the kernels; the codes stand
    in for what a format does not have (never read). ValueError where the pieces do not fit together."""
    q = quant or QuantizedKV()
    fmt = q.fmt
    hkv = kv_cache.shape[3]
    width = head_dim // 2 if fmt == "int4" else head_dim
    if fmt not in _QUANT or kv_cache.shape[-1] != width or (fmt != "auto" and kv_cache.dtype != torch.uint8):
        what = "uint8 codes" if fmt != "auto" else "values"
        raise ValueError(f"a {fmt!r} cache of head_dim {head_dim} holds {width} {what} per head; got "
                         f"{tuple(kv_cache.shape)} {kv_cache.dtype}")
    nb, bs = kv_cache.shape[1], kv_cache.shape[2]
    k_aux, v_aux, sal, k_res, v_res, s_strides = kv_cache[0], kv_cache[1], kv_cache, kv_cache, kv_cache, (0, 0, 0)
    nsal = 0
    if fmt == "fp8":
        if q.scales is None or q.scales.shape != kv_cache.shape[:-1]:
            raise ValueError(f"an fp8 cache needs scales of shape {tuple(kv_cache.shape[:-1])}")
        k_aux, v_aux, s_strides = q.scales[0], q.scales[1], q.scales[0].stride()
    elif fmt in ("int8", "int4"):
        want = {"key_grid": (nb, 2, hkv, head_dim), "value_grid": (nb, 2, bs, hkv)}
        for name, shape in want.items():
            t = getattr(q, name)
            if t is None or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"an {fmt} cache needs a contiguous {name} of shape {shape}")
        k_aux, v_aux = q.key_grid, q.value_grid
        if fmt == "int4" and q.salient is not None and q.salient.shape[1]:
            nsal = q.salient.shape[1]
            if tuple(q.salient.shape) != (nb, nsal, hkv) or q.residual is None or \
                    tuple(q.residual.shape) != (2, nb, nsal, hkv, head_dim // 2) or not q.residual[0].is_contiguous():
                raise ValueError(f"int4's salient tokens need offsets ({nb}, n, {hkv}) and low nibbles (2, {nb}, n, "
                                 f"{hkv}, {head_dim // 2})")
            sal, k_res, v_res = q.salient, q.residual[0], q.residual[1]
    k_win, v_win, table, w_strides = kv_cache[0], kv_cache[1], block_tables, (0, 0, 0, 0, 0)
    if q.window is not None:
        if q.table is None or q.table.shape[0] != block_tables.shape[0] or \
                tuple(q.window.shape[2:]) != (bs, hkv, head_dim):
            raise ValueError(f"a windowed cache needs a table [{block_tables.shape[0]}, blocks] and a window of "
                             f"blocks shaped ({bs}, {hkv}, {head_dim})")
        k_win, v_win, table = q.window[0], q.window[1], q.table
        w_strides = (*k_win.stride(), table.stride(0))
    pointers = (k_aux, v_aux, sal, k_res, v_res, k_win, v_win, table)
    consts = dict(HKV=hkv, QUANT=_QUANT[fmt], NSAL=nsal, NSAL_P2=max(1, triton.next_power_of_2(max(nsal, 1))),
                  WINDOWED=q.window is not None)
    return pointers, s_strides, w_strides, consts


def _dot_options(dtype: torch.dtype) -> dict:
    """fp32 caches: IEEE fp32 products (not TF32). bf16 under the CPU interpreter: upcast (see ``_mma``)."""
    upcast = dtype == torch.bfloat16 and INTERPRETED
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST_DOT=upcast)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                           scale: float, *, seq_ids: torch.Tensor | None = None, max_seq_len: int | None = None,
                           sliding_window: int | None = None, num_splits: int | None = None,
                           out: torch.Tensor | None = None, tune: dict | None = None,
                           quant: QuantizedKV | None = None) -> torch.Tensor:
    """Attention for decode rows (one query token each) over the paged cache.

    q: [T, H, D] (the whole step's query rows); sequence b's query is row ``query_start_loc[b]``. ``quant``: the
    cache holds quantized codes (and, windowed, a full-precision window), see ``QuantizedKV``.
    ``seq_ids`` ([n] int32) picks the decode sequences (default: all). ``max_seq_len`` (host int) sizes the split;
    it is read from the device when omitted. Results go to the decode rows of ``out`` ([T, H, D], allocated when
    None); other rows are left untouched. ``tune`` overrides ``decode_tuning`` (block_n, num_warps, num_stages)."""
    T, H, D = q.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    if H % hkv:
        raise ValueError(f"decode attention: q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)}")
    pointers, s_strides, w_strides, consts = _quant_args(kv_cache, quant, block_tables, D)
    if seq_ids is None:
        seq_ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    n = seq_ids.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens[seq_ids.long()].max().item())
    group = H // hkv
    if num_splits is None:
        num_splits = choose_num_splits(n, hkv, max_seq_len, _num_sms(q.device))
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, 16)))
    cfg = {**decode_tuning(q.dtype, D), **(tune or {})}
    kc, vc, consts["CODE_BYTES"], pointers = _code_views(kv_cache, quant,
                                                         cfg.get("code_bytes", default_code_bytes(D)), pointers)
    block_n = max(16, min(cfg["block_n"], triton.next_power_of_2(triton.cdiv(max_seq_len, num_splits))))
    # (a decode window starts its keys anywhere: tiles are whole blocks only without one)
    consts["GRID_BLOCKS"] = bool(cfg.get("grid_per_block", GRID_PER_BLOCK) and block_n % block_size == 0
                                 and not sliding_window)
    block_d = max(16, triton.next_power_of_2(D))
    single = num_splits == 1
    if single:
        mid_o = mid_lse = out                    # unused placeholders
        mo_strides, ml_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        mid_o = torch.empty(n, H, num_splits, D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(n, H, num_splits, dtype=torch.float32, device=q.device)
        mo_strides, ml_strides = mid_o.stride(), mid_lse.stride()
    window = sliding_window or 0
    _decode_partial_kernel[(n, hkv, num_splits)](
        q, kc, vc, *pointers, block_tables, seq_lens, query_start_loc, positions, seq_ids,
        out, mid_o, mid_lse,
        scale * _LOG2E, window, num_splits,
        *q.stride(), *out.stride(), *kc.stride(), *s_strides, *w_strides, block_tables.stride(0),
        *mo_strides, *ml_strides,
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=bool(sliding_window), SINGLE_SPLIT=single, **_dot_options(q.dtype), **consts,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not single:
        _decode_reduce_kernel[(n, H)](
            mid_o, mid_lse, out, query_start_loc, seq_ids, num_splits,
            *mo_strides, *ml_strides, *out.stride(),
            HEAD_DIM=D, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Prefill chunks and verification rows
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, k_aux, v_aux, sal, k_res, v_res, k_win, v_win, kv_window,
    block_tables, seq_lens, query_start_loc, positions, seq_ids,
    tree_mask, tree_offsets, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
    stride_wb, stride_ws, stride_wh, stride_wd, stride_kw, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HKV: tl.constexpr, QUANT: tl.constexpr, NSAL: tl.constexpr, NSAL_P2: tl.constexpr, WINDOWED: tl.constexpr,
    CODE_BYTES: tl.constexpr, GRID_BLOCKS: tl.constexpr,
):
    """Program (tile t, sequence i, kv head g): rows are (query token, head of group g) pairs, token-major, so
    BLOCK_M // GROUP consecutive query tokens share each K/V tile (GQA reads K/V once per kv head).

    Key range: context keys below the tile's lowest position minus the window are skipped; outside a token tree
    this step's tokens have consecutive positions, so keys after the tile's last token are skipped too (causal).
    Inside the range the visibility rule is applied exactly (see the module docstring)."""
    t = tl.program_id(0)
    i = tl.program_id(1)
    g = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    b = tl.load(seq_ids + i)
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    if t * TOKENS >= q_len:
        return
    seq_len = tl.load(seq_lens + b)
    ctx = seq_len - q_len                                # keys before this step's tokens

    r = tl.arange(0, BLOCK_M)
    tok = t * TOKENS + r // GROUP                        # query token index within the sequence's chunk
    rmask = (r < TOKENS * GROUP) & (tok < q_len)
    heads = g * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_row = q_start + tok
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    q_pos = tl.load(positions + q_row, mask=rmask, other=-1)       # padding rows see nothing

    last_tok = tl.minimum(t * TOKENS + TOKENS, q_len) - 1
    hi = ctx + last_tok + 1
    if HAS_TREE:
        tree_off = tl.load(tree_offsets + b)              # -1: this sequence has no tree
        hi = tl.where(tree_off >= 0, seq_len, hi)         # tree nodes may sit at equal or lower positions
    lo = 0
    if HAS_WINDOW:
        min_pos = tl.min(tl.where(rmask, q_pos, 2147483647), axis=0)
        lo = tl.maximum(tl.minimum(min_pos - window + 1, ctx), 0).to(tl.int32)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jmask = j < hi
        k, v = _kv_tile(k_cache, v_cache, k_aux, v_aux, sal, k_res, v_res, k_win, v_win, kv_window, bt_row, b, g, j,
                        jmask, d, dmask, stride_cb, stride_cs, stride_ch, stride_cd, stride_sb, stride_ss, stride_sh,
                        stride_wb, stride_ws, stride_wh, stride_wd, stride_kw, q_ptr,
                        BLOCK_SIZE, HKV, HEAD_DIM, QUANT, NSAL, NSAL_P2, WINDOWED, CODE_BYTES, GRID_BLOCKS)
        qk = _mma(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2       # [BLOCK_M, BLOCK_N]

        is_new = j >= ctx                                # this step's keys carry their token's position
        key_pos = tl.load(positions + q_start + (j - ctx), mask=jmask & is_new, other=0)
        key_pos = tl.where(is_new, key_pos, j)
        visible = (key_pos[None, :] <= q_pos[:, None]) & jmask[None, :] & rmask[:, None]
        if HAS_TREE:
            # (the scalar test is broadcast to a vector first: the CPU interpreter rejects scalar-bool masks)
            in_tree = jmask & is_new & (tl.zeros([BLOCK_N], tl.int32) + tree_off >= 0)
            tm = tl.load(tree_mask + tree_off + tok[:, None] * q_len + (j - ctx)[None, :],
                         mask=rmask[:, None] & in_tree[None, :], other=0)
            visible = tl.where(in_tree[None, :], (tm != 0) & rmask[:, None], visible)
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + _mma(pr.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def pack_tree_masks(tree_masks: dict[int, torch.Tensor], num_seqs: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """{seq index: [q_len, q_len] bool} -> (flat uint8 buffer, [num_seqs] int32 offsets, -1 = no tree)."""
    if not tree_masks:
        return None, None
    offsets = [-1] * num_seqs
    parts, pos = [], 0
    for i in sorted(tree_masks):
        m = tree_masks[i]
        offsets[i] = pos
        parts.append(m.reshape(-1).to(device=device, dtype=torch.uint8))
        pos += m.numel()
    return torch.cat(parts), torch.tensor(offsets, dtype=torch.int32, device=device)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                            scale: float, *, max_query_len: int, seq_ids: torch.Tensor | None = None,
                            sliding_window: int | None = None, tree_mask: torch.Tensor | None = None,
                            tree_offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            tune: dict | None = None, quant: QuantizedKV | None = None) -> torch.Tensor:
    """Attention for sequences with any number of query tokens (prefill chunks, verification rows).

    ``max_query_len`` (host int) sizes the grid. ``tree_mask``/``tree_offsets`` come from ``pack_tree_masks``.
    Results go to the rows of the selected sequences in ``out``; other rows are untouched. ``tune`` overrides
    ``prefill_tuning`` (block_m, block_n, num_warps, num_stages). ``quant``: as in ``paged_decode_attention``."""
    T, H, D = q.shape
    _, _, block_size, hkv, _ = kv_cache.shape
    if H % hkv:
        raise ValueError(f"prefill attention: q {tuple(q.shape)} does not fit the cache {tuple(kv_cache.shape)}")
    pointers, s_strides, w_strides, consts = _quant_args(kv_cache, quant, block_tables, D)
    if seq_ids is None:
        seq_ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    n = seq_ids.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if n == 0 or max_query_len == 0:
        return out
    group = H // hkv
    cfg = {**prefill_tuning(q.dtype, D, max_query_len * group), **(tune or {})}
    block_m, block_n = max(cfg["block_m"], 16, triton.next_power_of_2(group)), cfg["block_n"]
    tokens_per_tile = block_m // group
    has_tree = tree_mask is not None
    if not has_tree:
        tree_mask = tree_offsets = seq_ids          # unused placeholders
    kc, vc, consts["CODE_BYTES"], pointers = _code_views(kv_cache, quant,
                                                         cfg.get("code_bytes", default_code_bytes(D)), pointers)
    consts["GRID_BLOCKS"] = bool(cfg.get("grid_per_block", GRID_PER_BLOCK) and block_n % block_size == 0)
    grid = (triton.cdiv(max_query_len, tokens_per_tile), n, hkv)
    _prefill_kernel[grid](
        q, kc, vc, *pointers, block_tables, seq_lens, query_start_loc, positions, seq_ids,
        tree_mask, tree_offsets, out,
        scale * _LOG2E, sliding_window or 0,
        *q.stride(), *out.stride(), *kc.stride(), *s_strides, *w_strides, block_tables.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        HAS_WINDOW=bool(sliding_window), HAS_TREE=has_tree, **_dot_options(q.dtype), **consts,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
