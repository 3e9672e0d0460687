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
    """Per (token, head) scale s >= amax / 448 (float16): nothing saturates; values >= s * 2^-6 (normal e4m3) are
    within 2^-4 relative, smaller ones within s * 2^-10 absolute."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g, dtype=torch.float64) * torch.logspace(-5, 4, 32, dtype=torch.float64)
    x[3, 1, 5] = 1e5                                          # far beyond 448: the scale moves, no saturation
    s = kq.fp8_scale(x.float())
    assert s.dtype == torch.float16 and (s.double() * 448 >= x.abs().amax(-1)).all()
    assert (s.double() * 448 <= x.abs().amax(-1) * (1 + 2 ** -10)).all()
    back = kq.fp8_decode(kq.fp8_encode(x.float(), s), s, torch.float32).double()
    a, sd = x.abs(), s.double()[..., None]
    normal = a >= sd * 2 ** -6
    assert ((back - x).abs() <= 2 ** -4 * a)[normal].all()
    assert ((back - x).abs() <= sd * 2 ** -10)[~normal].all()
    assert back[3, 1, 5].item() == pytest.approx(1e5, rel=2 ** -4)


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
    assert KVLayout("fp8", **lay).bytes_per_block == full // 4 + 2 * 2 * 16 * 2 * 2      # + float16 token scales
    # int8: codes + float16 (zero, step) per key channel and per value token, in every layer
    assert KVLayout("int8", **lay).bytes_per_block == 2 * (2 * 16 * 2 * 16 + 2 * 2 * 16 * 2 + 2 * 16 * 2 * 2)
    assert KVLayout("int4", **lay).bytes_per_block == 2 * (16 * 2 * 16 + 2 * 2 * 16 * 2 + 2 * 16 * 2 * 2)
    assert (KVLayout("int4", **lay, num_salient=2).bytes_per_block
            == KVLayout("int4", **lay).bytes_per_block + 2 * (2 * 2 + 2 * 2 * 2 * 16 // 2))


# -- attention through the backend: block manager + input builder + torch backend, one layer --------------------
class Harness:
    """One attention layer over a (quantized) paged cache, driven like the scheduler drives it, beside a reference
    that keeps every token's full-precision K/V and dequantizes, with the reference quantizer, exactly the blocks
    that must be read quantized (those whose tokens are all final in the query's step)."""
    BS, HKV, HQ, D, SCALE = 4, 2, 4, 8, 8 ** -0.5

    def __init__(self, fmt: str, salient: int = 0, blocks: int = 24, window: int = 6, recent: int = 0,
                 defer: bool = False) -> None:
        cpu = torch.device("cpu")
        self.fmt = fmt
        self.cache = KVCache(1, blocks, self.BS, self.HKV, self.D, torch.float32, cpu, fmt, window, salient, recent)
        self.layer = self.cache.layer(0)
        windowed = self.cache.layout.windowed
        self.bm = BlockManager(blocks, self.BS, True, window if windowed else 0, recent, defer_seals=defer)
        self.num_deferred = 0                                                 # blocks sealed after their step
        self.buffers = InputBuffers(cpu, windowed=windowed)
        self.backend = TorchAttention()
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}     # seq_id -> full-precision K/V
        self.g = torch.Generator().manual_seed(11)
        self.err_fp = 0.0                                                     # max |out - full precision|

    def seq(self) -> Sequence:
        s = Sequence("h", 0, [1], SamplingParams())
        self.kv[s.seq_id] = []
        return s

    def step(self, work: list[tuple[Sequence, int, int]]) -> None:
        """work: (sequence, tokens, of which trailing draft tokens); checks every query row."""
        chunks, finals = [], []
        for seq, n, d in work:
            start = seq.num_computed_tokens
            assert self.bm.allocate(seq, start + n, start + n - d)
            sealing = self.bm.seal(seq, start + n - d)
            chunks.append(ScheduledSeq(seq.seq_id, start, (0,) * n, tuple(seq.block_table), samples=True,
                                       kv_window=self.bm.open_window(seq), kv_sealing=sealing))
            finals.append(start + n - d)
        deferred = self.bm.take_deferred_seals()                              # (after every open_window)
        plan = lay_out(0, self.BS, chunks)
        meta = self.buffers.build(plan, None).meta
        T = plan.num_tokens
        q = torch.randn(T, self.HQ, self.D, generator=self.g)
        k = torch.randn(T, self.HKV, self.D, generator=self.g) * 2
        k[..., 1] += 5                                                        # an offset channel
        v = torch.randn(T, self.HKV, self.D, generator=self.g)
        self.backend.plan(meta)
        self.backend.write_kv(k, v, self.layer, meta)
        out = self.backend.attend(q, self.layer, meta, self.SCALE)
        if deferred:                                   # quantized from the window once the step has read them
            self.cache.seal_from_window(*torch.tensor(deferred).T)
            self.num_deferred += len(deferred)
        row = 0
        for (seq, n, d), c, final in zip(work, chunks, finals):
            hist = self.kv[seq.seq_id]
            del hist[c.start:]
            hist += [(k[row + j], v[row + j]) for j in range(n)]
            K, V = torch.stack([h[0] for h in hist]), torch.stack([h[1] for h in hist])
            # blocks read quantized: with a window, those before the sequence's window blocks in this step's plan
            # (test_recent_tokens_seal_late checks which those are); without, every block (fp8)
            sealed = len(c.block_table) - len(c.kv_window) if self.cache.layout.windowed else len(c.block_table)
            Kq, Vq = self.reference_read(seq, K, V, sealed)
            for j in range(n):
                p = c.start + j
                want = self.attend(q[row + j], Kq[:p + 1], Vq[:p + 1])
                torch.testing.assert_close(out[row + j], want, rtol=1e-5, atol=1e-5)
                full = self.attend(q[row + j], K[:p + 1], V[:p + 1])
                self.err_fp = max(self.err_fp, (out[row + j] - full).abs().max().item())
            seq.num_computed_tokens += n
            row += n

    def reference_read(self, seq: Sequence, K: torch.Tensor, V: torch.Tensor, sealed: int):
        if self.fmt == "auto":
            return K, V
        if self.fmt == "fp8":
            Kq, Vq = (kq.fp8_decode(kq.fp8_encode(x, kq.fp8_scale(x)), kq.fp8_scale(x), torch.float32)
                      for x in (K, V))
            n = min(sealed * self.BS, len(K))                                 # token by token, up to the window
            return torch.cat((Kq[:n], K[n:])), torch.cat((Vq[:n], V[n:]))
        Kq, Vq = K.clone(), V.clone()
        bits = 8 if self.fmt == "int8" else 4
        for b in range(sealed):                                              # blocks quantized per block
            sl = slice(b * self.BS, (b + 1) * self.BS)
            block = seq.block_table[b]
            sal = None
            if self.cache.layout.num_salient:
                sal = self.cache.salient[0][block][None].numpy()
            for src, dst, keys in ((K, Kq, True), (V, Vq, False)):
                z, s, u = ref_block(src[sl][None].numpy(), keys, bits, sal)
                dst[sl] = torch.from_numpy(dequant(z, s, u)[0])
        return Kq, Vq

    def attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        rep = self.HQ // self.HKV
        return F.scaled_dot_product_attention(q[:, None], K.repeat_interleave(rep, 1).transpose(0, 1),
                                              V.repeat_interleave(rep, 1).transpose(0, 1), scale=self.SCALE)[:, 0]

    def move(self, seq: Sequence, pairs: list[tuple[int, int]], dst_seq: Sequence | None = None) -> None:
        """KV moves by position (tree compaction, or a fork's partial block into ``dst_seq``), as the scheduler
        emits them: ``BlockManager.kv_slot`` addresses, applied by ``KVCache.copy_slots``."""
        dst_seq = dst_seq or seq
        bs = self.BS
        src = [self.bm.kv_slot(seq.block_table[i // bs], i % bs) for i, _ in pairs]
        dst = [self.bm.kv_slot(dst_seq.block_table[j // bs], j % bs) for _, j in pairs]
        self.cache.copy_slots(torch.tensor(src), torch.tensor(dst))
        a, b = self.kv[seq.seq_id], self.kv[dst_seq.seq_id]
        moved = {j: a[i] for i, j in pairs}
        for j, kv in moved.items():
            b[j] = kv


@pytest.mark.parametrize("fmt,salient,tol,recent,defer", [
    ("auto", 0, 1e-5, 0, False), ("fp8", 0, 0.2, 0, False), ("int8", 0, 0.02, 0, False), ("int4", 0, 0.15, 0, False),
    ("int4", 1, 0.15, 0, False), ("fp8", 0, 0.2, 6, False), ("int8", 0, 0.02, 5, False), ("int4", 1, 0.15, 4, False),
    ("int8", 0, 0.02, 0, True), ("int4", 0, 0.15, 0, True), ("fp8", 0, 0.2, 6, True), ("int8", 0, 0.02, 5, True)])
def test_attention_with_a_quantized_cache(fmt, salient, tol, recent, defer):
    """Prefill chunks that fill blocks (sealed in their own step) and leave half-full ones (the window), decodes
    that complete a window block, draft tokens that are not final (their block stays open), a tree compaction,
    a block completed by accepted drafts (sealed the next step with no token of it in the step), and a beam-style
    fork that copies a partial block: every row equals attention over the reference-dequantized KV, and is within
    ``tol`` (absolute, values ~ N(0, 1)) of full precision. ``recent``: blocks seal only that many tokens behind
    their sequence's end, and are read from the full-precision window until then. ``defer`` (the engine's CPU
    default without salient tokens): a block whose earlier tokens are in the window seals after the step that
    completes it (read at full precision by that step, quantized like the reference by every later one); blocks
    a step fills from nothing still seal inside it."""
    h = Harness(fmt, salient, window=16 if recent else 6, recent=recent, defer=defer)
    A, B = h.seq(), h.seq()
    h.step([(A, 10, 0), (B, 3, 0)])           # A: blocks 0, 1 sealed in this step, block 2 half full; B: open
    h.step([(A, 1, 0), (B, 2, 0)])            # B's block 0 completes: sealed from the window plus this step
    h.step([(A, 5, 4), (B, 1, 0)])            # A: pos 11 completes block 2; 12..15 are drafts (block 3 open)
    h.move(A, [(14, 13), (15, 14)])           # a tree: nodes at 12, 14, 15 accepted, 13 was a rejected sibling
    A.num_computed_tokens = 15
    h.step([(A, 2, 1)])                       # pos 15 completes block 3 (sealed), 16 is a draft
    h.step([(A, 4, 3), (B, 1, 0)])            # pos 16 final; 17..19 drafts fill block 4 ...
    h.step([(A, 1, 0)])                       # ... all accepted: block 4 seals with none of its tokens in this step
    C = h.seq()                               # a fork of A: shares its 5 full blocks, copies the partial 6th
    C.num_computed_tokens = h.bm.share_prefix(A, C, 5)
    assert h.bm.allocate(C, 21)
    h.kv[C.seq_id] = list(h.kv[A.seq_id])
    h.move(A, [(20, 20)], dst_seq=C)
    C.num_computed_tokens = 21
    h.step([(A, 1, 0), (C, 3, 0), (B, 1, 0)])
    print(f"{fmt} salient={salient} recent={recent}: max |attention - full precision| = {h.err_fp:.4f}")
    assert h.err_fp <= tol, h.err_fp
    assert (h.num_deferred >= 3) == defer, h.num_deferred
    for s in (A, B, C):
        h.bm.free_seq(s)
    assert h.bm.num_free_blocks == h.bm.num_blocks
    assert len(h.bm.free_window) == h.bm.num_window_blocks


@pytest.mark.parametrize("fmt,salient,recent", [("fp8", 0, 0), ("fp8", 0, 6), ("int8", 0, 5), ("int8", 0, 0),
                                                 ("int4", 0, 0), ("int4", 1, 4)])
def test_the_cpu_kernel_reads_quantized_caches_in_place(fmt, salient, recent, monkeypatch):
    """On the CPU, decode and verification rows over quantized caches go through the exact kernel, which
    dequantizes each key and value row as it reads it (attention/cpu_exact.py): every row still equals attention
    over the reference-dequantized KV (the harness checks each one), and the kernel served them."""
    from leapdecode.attention import cpu_exact
    if cpu_exact.kernel() is None:
        pytest.skip("no C++ toolchain to build attention/cpu_exact.py")
    served = []
    real = cpu_exact.attend_quantized

    def spy(q, layer, *args):
        served.append(q.shape[0] * q.shape[1])
        return real(q, layer, *args)
    monkeypatch.setattr(cpu_exact, "attend_quantized", spy)
    from leapdecode.attention.torch_ref import TorchAttention
    h = Harness(fmt, salient, window=16 if recent else 6, recent=recent)
    h.backend = TorchAttention(exact="kernel")          # (the engine's CPU default; the harness's is "off")
    A, B = h.seq(), h.seq()
    h.step([(A, 10, 0), (B, 3, 0)])
    h.step([(A, 1, 0), (B, 2, 0)])
    h.step([(A, 5, 4), (B, 1, 0)])
    h.step([(A, 1, 0), (B, 1, 0)])
    assert len(served) >= 4 and sum(served) >= 8, served


def test_recent_tokens_seal_late():
    """With ``recent_tokens`` a block seals only once it lies that far behind its sequence's end (draft tokens
    do not count), keeps its window block until then, and a fork sharing it seals it for both."""
    bs, recent = 4, 6
    bm = BlockManager(16, bs, True, 12, recent)
    s = Sequence("r", 0, [1], SamplingParams())

    def step(n: int, drafts: int = 0) -> tuple[int, ...]:
        final = s.num_computed_tokens + n - drafts
        assert bm.allocate(s, s.num_computed_tokens + n, final)
        sealed = bm.seal(s, final)
        s.num_computed_tokens = final
        return sealed

    def num_sealed(seq: Sequence) -> int:
        return sum(bm.sealed[b] for b in seq.block_table)

    assert step(9) == () and num_sealed(s) == 0           # (9 - 6) // 4 = 0 blocks behind the recent tokens
    assert len(bm.open_window(s)) == 3                    # blocks 0, 1 (full, recent) and 2 (open)
    w0 = bm.window_of[s.block_table[0]]
    assert step(1) == (w0,) and num_sealed(s) == 1        # 10 - 6 = 4: block 0 seals, its window block returns
    assert step(5, drafts=4) == () and num_sealed(s) == 1  # 11 final tokens (+4 drafts): (11 - 6) // 4 = 1
    w1 = bm.window_of[s.block_table[1]]
    assert step(3) == (w1,) and num_sealed(s) == 2        # 14 final: block 1 seals
    assert len(bm.open_window(s)) == 2                    # block 2 (full, recent) and block 3 (open)
    fork = Sequence("f", 0, [1], SamplingParams())
    fork.num_computed_tokens = bm.share_prefix(s, fork, 3)  # shares block 2 (full, still recent: unsealed)
    shared = s.block_table[2]
    assert not bm.sealed[shared] and fork.block_table[2] == shared and bm.window_of[shared] >= 0
    w2 = bm.window_of[shared]
    assert bm.allocate(fork, 18, 18) and bm.seal(fork, 18) == (w2,)   # the fork runs ahead: (18 - 6) // 4 = 3
    assert bm.sealed[shared] and bm.window_of[shared] == -1
    assert bm.open_window(s) == (bm.window_of[s.block_table[3]],) and step(0) == ()
    bm.free_seq(s)
    bm.free_seq(fork)
    assert len(bm.free_window) == 12 and bm.num_free_blocks == 16


def test_finished_sequences_recent_blocks_are_sealed_late():
    """A finished sequence's full blocks still in the window (its recent tokens) are keyed at once and handed to the
    next plan as late seals (pool block, window block), so a later request finds the whole prefix cached; a block
    another sequence still holds is left to that sequence; preemption frees without sealing."""
    bs, recent = 4, 6
    bm = BlockManager(16, bs, True, 12, recent)
    s = Sequence("r", 0, list(range(100, 114)), SamplingParams(max_tokens=1))     # 14 tokens: 3 full blocks
    assert bm.allocate(s, 14) and bm.seal(s, 14) == (-1, -1)     # (14 - 6) // 4 = 2 blocks seal in the step
    bm.commit(s, 14)
    assert len(s.block_hashes) == 2 and [bm.sealed[b] for b in s.block_table] == [True, True, False, False]
    table, windows = list(s.block_table), [bm.window_of[b] for b in s.block_table]
    bm.free_seq(s, keep_recent=True)
    assert bm.late_seals == [(table[2], windows[2])]      # block 2 is full and final; block 3 holds 2 tokens
    assert bm.sealed[table[2]] and all(bm.window_of[b] < 0 for b in table)
    assert windows[2] not in bm.free_window and windows[3] in bm.free_window
    again = Sequence("r2", 0, list(range(100, 114)) + [7], SamplingParams(max_tokens=1))
    assert bm.match_prefix(again) == 12 and again.block_table == table[:3]
    assert bm.take_late_seals() == ((table[2], windows[2]),) and bm.late_seals == []
    assert len(bm.free_window) == 12
    bm.free_seq(again, keep_recent=True)
    assert bm.late_seals == []                            # nothing new: its blocks were sealed and keyed
    # a block shared with a live sequence is not sealed late (the live one still reads it from the window)
    a = Sequence("a", 0, list(range(200, 214)), SamplingParams(max_tokens=1))
    assert bm.allocate(a, 14)
    bm.seal(a, 14)
    bm.commit(a, 14)
    b = Sequence("b", 0, list(range(200, 214)), SamplingParams(max_tokens=1))
    b.num_computed_tokens = bm.share_prefix(a, b, 3)
    bm.free_seq(a, keep_recent=True)
    assert bm.late_seals == [] and not bm.sealed[b.block_table[2]] and bm.window_of[b.block_table[2]] >= 0
    bm.free_seq(b)                                        # preemption: frees, seals nothing
    assert bm.late_seals == [] and len(bm.free_window) == 12 and bm.num_free_blocks == 16


@pytest.mark.parametrize("bits", [4, 8])
def test_late_seal_quantizes_window_blocks_like_the_reference(bits):
    """``KVCache.seal_from_window`` (late seals and a step's deferred seals, every layer at once; no query to probe
    saliency with): each layer's window blocks become its pool blocks' codes as the reference quantizer writes
    them; int4 keeps each head's tokens with the largest keys (L2 norm) at 8 bits."""
    bs, h, d, n, L = 16, 3, 8, 2 if bits == 4 else 0, 3
    cache = KVCache(L, 6, bs, h, d, torch.float32, torch.device("cpu"), f"int{bits}", 4, n, 16)
    xs = []
    for layer in range(L):                                             # different keys and values per layer
        x = torch.stack([tile(20 + 2 * layer), tile(21 + 2 * layer)])[:, :2]    # [2 (k, v), 2 blocks, bs, h, d]
        x[0, :, 5 + layer] *= 100                                      # the token with the largest keys
        cache.window[layer][:, [3, 1]] = x
        xs.append(x)
    cache.seal_from_window(torch.tensor([4, 0]), torch.tensor([3, 1]))
    for layer, x in enumerate(xs):
        want = None
        if n:
            norms = x[0].double().norm(dim=-1).numpy()                 # [2, bs, h]
            want = np.sort(np.argsort(-norms, axis=1, kind="stable")[:, :n], axis=1)    # [2, n, h]
            assert (want == 5 + layer).any(axis=1).all()
            assert np.array_equal(cache.salient[layer][[4, 0]].numpy(), want)
        for i, keys in ((0, True), (1, False)):
            z, s, units = ref_block(x[i].numpy(), keys, bits, want)
            codes = cache.data[layer, i][[4, 0]]
            if bits == 8:
                got = codes
            else:
                got = kq.int4_units(kq.unpack_nibbles(codes), kq.unpack_nibbles(cache.residual[layer, i][[4, 0]]),
                                    cache.salient[layer][[4, 0]])
            assert np.array_equal(got.numpy().astype(np.int64), units)
            grid = cache.key_grid[layer][[4, 0]] if keys else cache.value_grid[layer][[4, 0]]   # [2 blocks, 2, ...]
            zs = (z[:, 0], s[:, 0]) if keys else (z[..., 0], s[..., 0])
            for j in range(2):
                assert np.array_equal(grid[:, j].numpy(), zs[j])


def test_recent_tokens_layout():
    lay = dict(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert not KVLayout("fp8", **lay).windowed and KVLayout("fp8", **lay, recent_tokens=1).windowed
    assert KVLayout("fp8", **lay, recent_tokens=17).recent_blocks == 2 == KVLayout("int8", **lay,
                                                                                   recent_tokens=32).recent_blocks
    assert KVLayout("int8", **lay).windowed and KVLayout("int8", **lay).recent_blocks == 0
    # the pool block costs the same with or without recent tokens: they live in the window
    assert KVLayout("fp8", **lay, recent_tokens=64).bytes_per_block == KVLayout("fp8", **lay).bytes_per_block


# -- the engine end to end on the tiny model ----------------------------------------------------------------------
MEMORY = 512 * 1024            # 64 float32 blocks of the tiny llama (2 layers, 2 kv heads, head_dim 16, 16 tokens)


def prompts_(n: int, seed: int, lo: int = 8, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 380, (int(m),), generator=g).tolist() for m in torch.randint(lo, hi, (n,), generator=g)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_window_free(llm) -> None:
    """Every window block is free, or held by a finished sequence's late seal (until the next plan takes it)."""
    bm = llm.engine.block_manager
    held = [w for _, w in bm.late_seals]
    assert sorted(bm.free_window + held) == list(range(bm.num_window_blocks)) and all(w < 0 for w in bm.window_of)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Full-precision greedy outputs (kv_cache_dtype left at its default) and their LLM."""
    llm = make_llm(llama_dir, kv_cache_memory=MEMORY)
    prompts = prompts_(6, seed=0)
    return llm, prompts, tokens(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_auto_is_todays_cache(llama_dir, reference):
    """kv_cache_dtype="auto": the same pool (blocks = memory // a float32 block), no window, the same greedy
    tokens as the default, which are transformers' own."""
    import transformers
    base, prompts, ref = reference
    llm = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="auto")
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
    full = 2 * 2 * 16 * 2 * 16 * 4
    for x in (base, llm):
        info = x.kv_cache_info()
        assert info["num_blocks"] == MEMORY // full == x.engine.block_manager.num_blocks == 64
        assert info["bytes_per_token"] == full / 16 and info["dtype"] == "float32" and info["lossy"] is False
        assert info["num_window_blocks"] == 0 and not x.engine.block_manager.windowed
        assert x.engine.runner.kv_cache.data.dtype == torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ids = torch.tensor([prompts[0]])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=1)[0, ids.shape[1]:].tolist()
    assert ref[0] == want
    assert_pool_free(llm)


def test_quantized_formats_fit_more_blocks(llama_dir):
    """Same kv_cache_memory, real block sizes: fp8 3.5x the float32 blocks (codes and per-token scales); int8/int4
    spend at most a quarter on the full-precision window and fit the rest at their size, codes and scales
    included."""
    infos = {f: make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype=f).kv_cache_info()
             for f in ("auto", "fp8", "int8", "int4")}
    print({f: (i["num_blocks"], i["num_window_blocks"], i["bytes_per_token"]) for f, i in infos.items()})
    assert infos["fp8"]["num_blocks"] == MEMORY // (2 * (2 * 16 * 2 * 16 + 2 * 16 * 2 * 2)) == 227
    assert infos["int8"]["num_blocks"] > 2 * infos["auto"]["num_blocks"]
    assert infos["int4"]["num_blocks"] > 1.5 * infos["int8"]["num_blocks"]
    for f, i in infos.items():
        assert i["total_bytes"] <= MEMORY and i["lossy"] == (f != "auto") and i["block_size"] == 16
        assert i["bytes_per_token"] == i["bytes_per_block"] / 16
    assert infos["int8"]["dtype"] == "int8" and infos["fp8"]["dtype"] == "fp8_e4m3"
    assert infos["int4"]["salient_tokens_per_block"] == 2 and infos["int8"]["num_window_blocks"] >= 1


def test_int8_end_to_end(llama_dir, reference):
    """int8 greedy output against full precision on the tiny random model (chaotic: its large init makes 0.4%
    noise on K/V flip tokens, so agreement is measured teacher-forced: the int8 cache's top-1 at every position of
    the full-precision output); no block or window block left behind."""
    _, prompts, ref = reference
    llm = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="int8")
    outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert_pool_free(llm)
    assert_window_free(llm)
    tf = llm.generate([p + r for p, r in zip(prompts, ref)], SamplingParams(max_tokens=1, prompt_logprobs=1),
                      use_tqdm=False)
    hits = [max(o.prompt_logprobs[len(p) + i].items(), key=lambda kv: kv[1])[0] == t
            for p, r, o in zip(prompts, ref, tf) for i, t in enumerate(r)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(outs, ref)]
    print(f"int8: teacher-forced top-1 agreement {sum(hits) / len(hits):.3f}, first divergence {first}")
    assert sum(hits) / len(hits) >= 0.9
    assert_pool_free(llm)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_prefix_cache_hits_equal_misses(llama_dir, fmt):
    """A prompt prefix cached by an earlier request is read quantized, exactly as the request that computed it read
    it: warm runs (hits) give the tokens of cold runs (prefix caching off)."""
    shared = prompts_(1, seed=5, lo=40, hi=41)[0]
    prompts = [shared + t for t in prompts_(4, seed=6, lo=3, hi=20)]
    cold = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype=fmt, enable_prefix_caching=False)
    warm = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype=fmt)
    want = [tokens(cold.generate(prompts[:1], GREEDY, use_tqdm=False)), tokens(cold.generate(prompts, GREEDY,
                                                                                              use_tqdm=False))]
    got = [tokens(warm.generate(prompts[:1], GREEDY, use_tqdm=False)), tokens(warm.generate(prompts, GREEDY,
                                                                                             use_tqdm=False))]
    assert got == want
    assert warm.engine.block_manager.hits >= 4 * 32                  # two full blocks of the prefix, four requests
    for llm in (cold, warm):
        assert_pool_free(llm)
        assert_window_free(llm)


def test_drafts_beams_forks_and_async_with_int8(llama_dir, reference):
    """Speculation with token trees (draft tokens in open blocks, tree compaction through copy_slots), beam search
    (forks copy their partial block), n > 1 and the overlapped step all run on an int8 cache without leaking a
    block or a window block; the overlapped step gives the synchronous step's tokens."""
    from leapdecode.decoding.beam_search import BeamSearchParams
    _, prompts, ref = reference
    sync = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="int8")
    plain = tokens(sync.generate(prompts, GREEDY, use_tqdm=False))
    drafter = OracleDrafter({tuple(p): [r] for p, r in zip(prompts, plain)}, tree=True)
    spec = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="int8",
                    speculative_config={"method": "ngram", "num_speculative_tokens": 6, "adaptive": False,
                                        "drafter": drafter})
    outs = spec.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert max(o.metrics.num_accepted_tokens for o in outs) > 0
    beams = sync.beam_search([prompts[0]], BeamSearchParams(beam_width=3, max_tokens=12))[0]
    assert len(beams.sequences) == 3
    n2 = sync.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)
    assert all(len(c.token_ids) == 8 for o in n2 for c in o.outputs)
    overlapped = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="int8", async_scheduling=True)
    assert tokens(overlapped.generate(prompts, GREEDY, use_tqdm=False)) == plain
    for llm in (sync, spec, overlapped):
        assert_pool_free(llm)
        assert_window_free(llm)


def test_fp8_and_int4_end_to_end(llama_dir, reference):
    _, prompts, ref = reference
    for fmt, extra in (("fp8", {}), ("int4", {}), ("int4", {"kv_cache_salient_ratio": 0.0})):
        llm = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype=fmt, **extra)
        outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert all(len(o) == GREEDY.max_tokens for o in outs)
        assert_pool_free(llm)
        if fmt == "int4":
            assert_window_free(llm)
            assert llm.kv_cache_info()["salient_tokens_per_block"] == (0 if extra else 2)


def test_recent_tokens_covering_every_sequence_are_lossless(llama_dir, reference):
    """A quantized cache whose recent tokens cover every sequence never quantizes anything: its greedy tokens are
    full precision's (transformers' own), bit for bit; with no recent tokens fp8 keeps its per-token cache."""
    _, prompts, ref = reference
    for fmt in ("fp8", "int8", "int4"):
        llm = make_llm(llama_dir, kv_cache_memory=4 * MEMORY, kv_cache_dtype=fmt, kv_cache_recent_tokens=128)
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref, fmt
        info = llm.kv_cache_info()
        assert info["recent_tokens"] == 128 and info["num_window_blocks"] >= 128 // 16 + 1
        assert_pool_free(llm)
        assert_window_free(llm)
    plain = make_llm(llama_dir, kv_cache_memory=MEMORY, kv_cache_dtype="fp8")
    assert not plain.engine.block_manager.windowed and plain.kv_cache_info()["recent_tokens"] == 0


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_finished_recent_blocks_stay_in_the_prefix_cache(llama_dir, fmt):
    """With recent tokens, a finished request's newest full blocks are sealed late: a request that continues its
    text finds every full block cached, and an export right after it finishes holds every full block, bit for
    bit the blocks an engine that kept decoding past them sealed the usual way (fails without late seals: the
    recent blocks are neither cached nor exported)."""
    prompt = prompts_(1, seed=3, lo=40, hi=41)[0]
    short, long_ = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), \
        SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_memory=2 * MEMORY, kv_cache_dtype=fmt, kv_cache_recent_tokens=32)
    llm = make_llm(llama_dir, **kw)
    out = llm.generate([prompt], short, use_tqdm=False)[0].outputs[0].token_ids
    text = prompt + list(out)
    full = (len(text) - 1) // 16                          # blocks of final KV (the last token was never computed)
    exported = llm.engine.export_kv(text)
    assert len(exported.token_ids) == full * 16 and llm.engine.block_manager.late_seals == []
    bm = llm.engine.block_manager
    hits = bm.hits
    llm.generate([text + [5]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert bm.hits - hits == full * 16
    ref = make_llm(llama_dir, **kw)                       # decodes 50 tokens further: the same blocks seal in steps
    assert list(ref.generate([prompt], long_, use_tqdm=False)[0].outputs[0].token_ids[:40]) == list(out)
    sealed = ref.engine.export_kv(text[:full * 16])
    assert sealed.token_ids == exported.token_ids
    for mine, theirs in zip(exported.blocks, sealed.blocks):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
    assert_pool_free(llm)
    assert_window_free(llm)


def test_an_import_applies_pending_late_seals_first(llama_dir):
    """A KV import between steps hands out free blocks at once, one of which may still wait for its late seal: the
    engine applies pending seals before installing, so every imported block holds exactly the transferred KV and
    the finished request's blocks stay cached."""
    kw = dict(kv_cache_dtype="int8", kv_cache_recent_tokens=32, num_kv_blocks=8, max_model_len=128)
    src, dst = make_llm(llama_dir, **kw), make_llm(llama_dir, **kw)
    a, b = prompts_(1, seed=5, lo=80, hi=81)[0], prompts_(1, seed=6, lo=60, hi=61)[0]
    src.generate([a], GREEDY, use_tqdm=False)
    sent = src.engine.export_kv(a)
    dst.generate([b], GREEDY, use_tqdm=False)                   # 84 tokens: blocks 3 and 4 are sealed late
    bm = dst.engine.block_manager
    pending = [blk for blk, _ in bm.late_seals]
    assert len(pending) == 2                              # b's recent blocks wait for the next step ...
    assert dst.engine.import_kv(sent) == len(sent.token_ids) == 80
    blocks = bm.cached_blocks(list(a))
    assert set(pending) & set(blocks)                     # ... the import took (some of) their blocks,
    dst.generate([[7, 8, 9]], SamplingParams(max_tokens=1), use_tqdm=False)     # and a step ran since
    for got, want in zip(dst.engine.runner.read_kv_blocks(blocks), sent.blocks):
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert_window_free(dst)


def test_recent_tokens_shrink_the_error(llama_dir):
    """Teacher-forced prompt logprobs of long prompts (chunked prefill, so earlier chunks are read from the cache)
    against full precision: keeping the 32 newest tokens at full precision lowers fp8's and int4's error."""
    prompts = prompts_(4, seed=9, lo=90, hi=120)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(**kw) -> torch.Tensor:
        llm = make_llm(llama_dir, kv_cache_memory=4 * MEMORY, max_num_batched_tokens=32, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_pool_free(llm)
        return torch.tensor([lp[t] for p, o in zip(prompts, outs) for lp, t in zip(o.prompt_logprobs[1:], p[1:])])

    full = logprobs()
    for fmt in ("fp8", "int4"):
        err = [(logprobs(kv_cache_dtype=fmt, kv_cache_recent_tokens=r) - full).abs().mean().item() for r in (0, 32)]
        print(f"{fmt}: mean |logprob error| recent 0 / 32 tokens: {err[0]:.4f} / {err[1]:.4f}")
        assert err[1] < 0.8 * err[0], (fmt, err)


@pytest.mark.parametrize("value", ["int3", "", None, 8, "FP8", "bf16"])
def test_bad_kv_cache_dtype(value):
    from leapdecode.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="unused", kv_cache_dtype=value)


def test_bad_combinations(llama_dir):
    from leapdecode.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_salient_ratio"):
        EngineConfig(model="unused", kv_cache_dtype="int8", kv_cache_salient_ratio=0.2)
    with pytest.raises(ValueError, match="kv_cache_salient_ratio"):
        EngineConfig(model="unused", kv_cache_dtype="int4", kv_cache_salient_ratio=1.5)
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="kv_cache_recent_tokens"):
            EngineConfig(model="unused", kv_cache_dtype="fp8", kv_cache_recent_tokens=bad)
    with pytest.raises(ValueError, match="kv_cache_recent_tokens"):
        EngineConfig(model="unused", kv_cache_recent_tokens=16)          # "auto" has nothing to keep
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_llm(llama_dir, kv_cache_dtype="int8", speculative_config={"method": "layer_skip"})
    with pytest.raises(ValueError, match="kv_cache_recent_tokens=0"):
        make_llm(llama_dir, kv_cache_dtype="fp8", kv_cache_recent_tokens=16, speculative_config={"method": "layer_skip"})


def test_cli_flag():
    from leapdecode.cli import build_parser
    for command in (["serve"], ["generate", "x"], ["chat"], ["bench"]):
        args = build_parser().parse_args([*command, "--kv-cache-dtype", "int4", "--kv-cache-recent-tokens", "64"])
        assert args.kv_cache_dtype == "int4" and args.kv_cache_recent_tokens == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--kv-cache-dtype", "int3"])


def _resident(t: torch.Tensor, offsets: list[int]) -> list[bool]:
    """Whether the pages holding these byte offsets of ``t`` are mapped in memory (Linux ``mincore``)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    out = []
    for off in offsets:
        addr = (t.data_ptr() + off) // page * page
        vec = (ctypes.c_ubyte * 1)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(page), vec) != 0:
            pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
        out.append(bool(vec[0] & 1))
    return out


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_the_pools_first_page_of_each_plane_is_written_at_start_up(fmt):
    """A CPU pool maps each plane's first page at allocation (the first requests' blocks, whose first write would
    otherwise map and zero a huge page each inside a step: ~0.4 s of the default model's first request on the
    2-core VM) and leaves the rest unmapped until used (a big pool costs no memory up front). Fails if nothing is
    written at start-up, or everything is."""
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("mincore: Linux")
    L, blocks, bs, h, d = 3, 4096, 16, 2, 64
    cache = KVCache(L, blocks, bs, h, d, torch.float32, torch.device("cpu"), fmt, 4 if fmt != "auto" else 0)
    data = cache.data
    plane = data[0, 0].numel() * data.element_size()
    firsts = [p * plane for p in range(2 * L)]
    middles = [p * plane + plane // 2 for p in range(2 * L)]
    assert all(_resident(data, firsts)), _resident(data, firsts)
    assert not any(_resident(data, middles)), _resident(data, middles)
