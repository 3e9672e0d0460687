"""The quantized KV cache (``kv_cache_dtype``: fp8, int8, int4; lossy, opt-in): round-trip error bounds against
float64, the integer codes bit-exact against a reference quantizer written here from the equations, attention
through the backend against a reference that dequantizes the same blocks (and against full precision within stated
tolerances), the block manager's window bookkeeping, and the engine end to end: "auto" unchanged, more blocks in
the same memory, prefix-cache hits equal to misses, no block or window leak."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import OracleDrafter, assert_pool_free, make_llm
from leapdecode import SamplingParams
from leapdecode.attention import kv_quant as kq
from leapdecode.attention.kv_cache import KVCache, KVLayout
from leapdecode.attention.torch_ref import TorchAttention
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.input_batch import InputBuffers
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import ScheduledSeq, lay_out

F16, F32 = np.float16, np.float32
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# -- the reference quantizer, from the equations in kv_quant's docstring --------------------------------------------
def ref_grid(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 zero <= lo (rounded down), float16 step >= (hi - zero) / 255 (rounded up, at least 2^-24)."""
    lo = np.clip(lo.astype(F32), -65504, 65504)
    hi = np.clip(hi.astype(F32), -65504, 65504)
    z = lo.astype(F16)
    z = np.where(z.astype(F32) > lo, np.nextafter(z, F16(-np.inf)), z)
    s = np.maximum((hi - z.astype(F32)) / F32(255), F32(2.0 ** -24)).astype(F32)
    s16 = s.astype(F16)
    s16 = np.where(s16.astype(F32) < s, np.nextafter(s16, F16(np.inf)), s16)
    return z, s16


def ref_codes(x: np.ndarray, z: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
    """8 bits: u = round((x - z) / s) in [0, 255]; 4 bits: q = round((x - z) / 17 s) in [0, 15] (float32)."""
    step = s.astype(F32) if bits == 8 else F32(17) * s.astype(F32)
    top = 255 if bits == 8 else 15
    return np.clip(np.rint((x.astype(F32) - z.astype(F32)) / step), 0, top).astype(np.uint8)


def ref_block(x: np.ndarray, keys: bool, bits: int, salient: np.ndarray | None = None):
    """A tile [S, bs, H, D] -> (zero, step, units on the 255-level grid): keys per channel, values per token."""
    axis = 1 if keys else 3
    z, s = ref_grid(x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True))
    units = ref_codes(x, z, s, bits).astype(np.int64) * (1 if bits == 8 else 17)
    if salient is not None:                               # [S, n, H] offsets keep 8-bit units
        for si, ti, hi in np.ndindex(*salient.shape):
            t = salient[si, ti, hi]
            zz = z[si, 0 if keys else t, hi]
            ss = s[si, 0 if keys else t, hi]
            units[si, t, hi] = ref_codes(x[si, t, hi], zz, ss, 8)
    return z, s, units


def dequant(z, s, units) -> np.ndarray:
    return z.astype(F32) + s.astype(F32) * units.astype(F32)


def tile(seed: int, shape=(5, 16, 3, 8), outlier_channel: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:1] + (1, 1, 1), generator=g) * 4
    if outlier_channel:
        x[..., 2] = x[..., 2] * 20 + 7                   # a key outlier channel with an offset (KIVI's observation)
    return x


# -- round trips ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_int_codes_bit_exact_and_within_half_a_step(keys, bits):
    x = tile(1 + bits + keys)
    z, s = kq.key_grid(x) if keys else kq.value_grid(x)
    codes = kq.encode_units(x, z, s, bits)
    rz, rs, runits = ref_block(x.numpy(), keys, bits)
    assert np.array_equal(z.numpy(), rz) and np.array_equal(s.numpy(), rs)
    assert np.array_equal(codes.numpy().astype(np.int64) * (1 if bits == 8 else 17), runits)
    # every value within half a step of its code (float64 reference); step = s (int8) or 17 s (int4)
    back = kq.decode_units(codes.to(torch.int16) * (1 if bits == 8 else 17), z, s).double()
    step = s.double() * (1 if bits == 8 else 17)
    ratio = ((back - x.double()).abs() / step).max().item()
    assert ratio <= 0.5 + 1e-4, ratio
    # the grid covers [min, max] of its group, so nothing is clamped
    lo, hi = (x.amin(1, True), x.amax(1, True)) if keys else (x.amin(-1, True), x.amax(-1, True))
    assert (z.float() <= lo).all() and (z.float() + 255 * s.float() >= hi - 1e-6 * hi.abs()).all()


def test_int4_salient_tokens_keep_8_bits():
    x = tile(7)
    g = torch.Generator().manual_seed(3)
    salient = torch.stack([torch.randperm(16, generator=g)[:3].sort().values for _ in range(5 * 3)])
    salient = salient.view(5, 3, 3).transpose(1, 2).to(torch.uint8)          # [S, n, H]
    for keys in (True, False):
        z, s = kq.key_grid(x) if keys else kq.value_grid(x)
        codes, residual = kq.encode_int4(x, z, s, salient)
        units = kq.int4_units(codes, residual, salient)
        _, _, runits = ref_block(x.numpy(), keys, 4, salient.numpy())
        assert np.array_equal(units.numpy().astype(np.int64), runits)
        err = (kq.decode_units(units, z, s).double() - x.double()).abs() / s.double()
        is_sal = torch.zeros(5, 16, 3, dtype=torch.bool).scatter_(1, salient.long(), True)
        assert err[is_sal].max() <= 0.5 + 1e-4                # salient: half a fine step
        assert err[~is_sal].max() <= 8.5 + 1e-3               # the rest: half an int4 step (17 / 2)
        assert err[~is_sal].max() > 1.0                       # (and they really are int4)


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (4, 5, 6), dtype=torch.uint8)
    packed = kq.pack_nibbles(codes)
    assert packed.shape == (4, 5, 3) and torch.equal(kq.unpack_nibbles(packed), codes)


def test_fp8_error_bounds_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g, dtype=torch.float64) * torch.logspace(-4, 3, 32, dtype=torch.float64)
    scale = torch.ones(4)
    back = kq.fp8_decode(kq.fp8_encode(x.float(), scale), scale, torch.float32).double()
    a = x.abs()
    normal = (a >= 2 ** -6) & (a <= 448)
    assert ((back - x).abs() <= 2 ** -4 * a)[normal].all()            # 3 mantissa bits: half an ulp relative
    assert ((back - x).abs() <= 2 ** -10)[a < 2 ** -6].all()          # subnormals: absolute 2^-10
    assert (back[a > 448].abs() == 448).all()                          # saturates (the documented failure mode)
    # a per-head scale moves the range: scale 4 keeps 1800 finite
    assert kq.fp8_decode(kq.fp8_encode(torch.full((1, 1), 1800.0), torch.tensor([4.0])), torch.tensor([4.0]),
                         torch.float32).item() == pytest.approx(1792.0)


def test_saliency_is_normalized_attention():
    """normalized_attention against a float64 loop: probe p sees keys <= p; score = attention received / number of
    probes that see the key, averaged over the query heads of the kv head."""
    g = torch.Generator().manual_seed(5)
    S, bs, Hq, Hkv, D = 3, 8, 4, 2, 16
    q, k = torch.randn(S, bs, Hq, D, generator=g), torch.randn(S, bs, Hkv, D, generator=g)
    valid = torch.rand(S, bs, generator=g) > 0.4
    valid[0] = False
    valid[0, bs - 1] = True                               # one probe only, seeing the whole block
    got = kq.normalized_attention(q, k, valid, 0.25)
    want = torch.zeros(S, Hkv, bs, dtype=torch.float64)
    for s in range(S):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            recv, cnt = torch.zeros(bs, dtype=torch.float64), torch.zeros(bs)
            for p in range(bs):
                if valid[s, p]:
                    w = torch.softmax((k[s, :p + 1, kv].double() @ q[s, p, h].double()) * 0.25, 0)
                    recv[:p + 1] += w
                    cnt[:p + 1] += 1
            want[s, kv] += recv / cnt.clamp(min=1) / (Hq // Hkv)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    top = kq.top_salient(got, 3)
    assert top.shape == (S, 3, Hkv)
    for s in range(S):
        for h in range(Hkv):
            assert sorted(torch.argsort(-want[s, h], stable=True)[:3].tolist()) == top[s, :, h].tolist()


def test_layout_bytes():
    lay = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    full = 2 * 2 * 16 * 2 * 16 * 4
    assert KVLayout("auto", **lay).bytes_per_block == full == KVCache.bytes_per_block(2, 16, 2, 16, torch.float32)
    assert KVLayout("fp8", **lay).bytes_per_block == full // 4
    # int8: codes + float16 (zero, step) per key channel and per value token, in every layer
    assert KVLayout("int8", **lay).bytes_per_block == 2 * (2 * 16 * 2 * 16 + 2 * 2 * 16 * 2 + 2 * 16 * 2 * 2)
    assert KVLayout("int4", **lay).bytes_per_block == 2 * (16 * 2 * 16 + 2 * 2 * 16 * 2 + 2 * 16 * 2 * 2)
    assert (KVLayout("int4", **lay, num_salient=2).bytes_per_block
            == KVLayout("int4", **lay).bytes_per_block + 2 * (2 * 2 + 2 * 2 * 2 * 16 // 2))
