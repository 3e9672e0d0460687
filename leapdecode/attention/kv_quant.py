"""The arithmetic of a quantized KV cache (lossy, opt-in: ``kv_cache_dtype``); the layout lives in ``kv_cache.py``.

**fp8** (``float8_e4m3fn``): ``code = e4m3(x / s)``, ``x' = float(code) * s`` with one float16 scale per (token,
kv head): ``s = amax / 448`` rounded up, so nothing saturates and every value down to amax / 2^15 stays a normal
e4m3 number (relative error <= 2^-4, 3 mantissa bits); below that the absolute error is <= s * 2^-10. Why per
token rather than one scale per head: vLLM's uncalibrated default (a fixed scale 1.0 per head) costs SmolLM2-135M
+1.7% perplexity, because 42% of its first layer's values lie below e4m3's smallest normal (2^-6); a running amax
per head would change the meaning of codes already written, or make a request's output depend on the traffic
before it. The per-token scale costs 2 bytes per head vector (3% at head_dim 64) and is written with the token.

**int8 / int4**, after KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML
2024): asymmetric integer codes, **keys per channel** (one zero point and step per (kv head, channel) over the
tokens of a block: key outliers sit in fixed channels) and **values per token** (one zero point and step per (token,
kv head) over its channels). Both use the same 255-level grid: ``x' = z + s * u`` with ``u`` in [0, 255]; int8
stores ``u`` itself, int4 stores ``q = round((x - z) / 17s)`` in [0, 15] (``u = 17 q``: 15 * 17 = 255, so the int4
grid is a sub-grid of the int8 one). ``z`` and ``s`` are stored as float16, ``z`` rounded down and ``s`` rounded
up, so the grid always covers [min, max] and every value is within half a step of its code.

**Salient tokens** (int4), after ZipCache (He et al., "ZipCache: Accurate and Efficient KV Cache Quantization with
Salient Token Identification", NeurIPS 2024): the tokens of a block that receive the most *normalized* attention
(attention received divided by the number of queries that could attend to it, so early tokens are not favoured)
keep 8-bit precision: their 8-bit unit ``u`` is split into a high nibble, stored in the int4 plane, and a low
nibble, stored in a small residual plane (``u = 16 hi + lo``). The saliency probes are the queries of the block's
own tokens in the step that seals it (all of them for a prefill, the last one for a decode; for a block completed
by accepted draft tokens, the sequence's next query), see ``normalized_attention``.

A block is read quantized from the step in which its last token becomes final, by every query of that step (so a
prefix-cache hit reads exactly what the miss that computed it read); before that it is read at full precision.
Outputs therefore depend slightly on where a chunked prefill or a draft ends inside a block.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")
ALIASES = {"fp8_e4m3": "fp8"}
FP8_MAX = 448.0                  # largest finite float8_e4m3fn
LEVELS = 255                     # the fine (8-bit) grid; int4 uses every 17th level
INT4_STRIDE = 17
_FP16_MAX = 65504.0


def parse_kv_cache_dtype(value: str) -> str:
    """The canonical format name, or ValueError naming ``kv_cache_dtype``."""
    name = ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return name


# -- fp8 --------------------------------------------------------------------------------------------------------
def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-vector scales [..., H] of x [..., H, D]: amax / 448 rounded up to float16 (at least 2^-24)."""
    s = (x.float().abs().amax(dim=-1) / FP8_MAX).clamp_(2.0 ** -24, _FP16_MAX)
    return _fp16_toward(s, float("inf"))


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] with its scales [..., H] -> uint8 codes (the bits of float8_e4m3fn, so any indexing op works)."""
    y = (x.float() / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, D] -> (uint8 codes, float16 scales [..., H]): ``fp8_scale`` then ``fp8_encode``."""
    s = fp8_scale(x)
    return fp8_encode(x, s), s


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes [..., H, D] and scales [..., H] -> values in ``dtype``."""
    return (codes.view(torch.float8_e4m3fn).float() * scale.float()[..., None]).to(dtype)


# -- the affine integer grid ------------------------------------------------------------------------------------
def _fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """float16 nearest to ``x`` on the side of ``direction`` (-inf: <= x, +inf: >= x)."""
    h = x.to(torch.float16)
    off = h.float() > x if direction < 0 else h.float() < x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, direction)), h)


def grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 255-level grid over [lo, hi]: float16 (zero, step) with zero <= lo and zero + 255 step >= hi."""
    lo = lo.float().clamp(-_FP16_MAX, _FP16_MAX)
    hi = hi.float().clamp(-_FP16_MAX, _FP16_MAX)
    zero = _fp16_toward(lo, float("-inf"))
    step = ((hi - zero.float()) / LEVELS).clamp_(min=2.0 ** -24)
    return zero, _fp16_toward(step, float("inf"))


def encode_units(x: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` on the grid (zero, step broadcast against x): 8 bits -> u in [0, 255]; 4 bits -> q in [0, 15]."""
    z, s = zero.float(), step.float()
    if bits == 8:
        return torch.round((x.float() - z) / s).clamp_(0, LEVELS).to(torch.uint8)
    return torch.round((x.float() - z) / (INT4_STRIDE * s)).clamp_(0, 15).to(torch.uint8)


def decode_units(units: torch.Tensor, zero: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``z + s * u`` in float32."""
    return zero.float() + step.float() * units.float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes in [0, 15] -> [..., D / 2] bytes (even channel in the low nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


# -- blocks -----------------------------------------------------------------------------------------------------
# A block tile is [S, bs, H, D]; its grids are kept broadcastable against it: keys [S, 1, H, D], values [S, bs, H, 1].
def key_grid(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (zero, step) [S, 1, H, D] over the block's tokens (KIVI's keys)."""
    return grid(k.amin(dim=1, keepdim=True), k.amax(dim=1, keepdim=True))


def value_grid(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (zero, step) [S, bs, H, 1] over the channels (KIVI's values)."""
    return grid(v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True))


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [S, n, H, D] (block offsets) of a tile or of a per-token grid; a per-channel grid is shared."""
    if t.shape[1] == 1:
        return t
    return t.gather(1, idx if t.shape[-1] == idx.shape[-1] else idx[..., :1])


def encode_int4(x: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, salient: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int4 codes [S, bs, H, D] of a tile; the ``salient`` tokens ([S, n, H] offsets) keep their 8-bit units:
    the high nibble replaces their int4 code, the low nibble is returned as the residual plane [S, n, H, D]."""
    codes = encode_units(x, zero, step, 4)
    if salient is None or salient.shape[1] == 0:
        return codes, None
    idx = salient.long()[..., None].expand(-1, -1, -1, x.shape[-1])
    units = encode_units(x.gather(1, idx), _take(zero, idx), _take(step, idx), 8)
    codes.scatter_(1, idx, units >> 4)
    return codes, units & 15


def int4_units(codes: torch.Tensor, residual: torch.Tensor | None, salient: torch.Tensor | None) -> torch.Tensor:
    """int4 codes [S, bs, H, D] (+ the salient tokens' low nibbles) -> units on the 255-level grid."""
    units = codes.to(torch.int16) * INT4_STRIDE
    if residual is not None and residual.shape[1]:
        idx = salient.long()[..., None].expand(-1, -1, -1, codes.shape[-1])
        units.scatter_(1, idx, codes.gather(1, idx).to(torch.int16) * 16 + residual.to(torch.int16))
    return units


def normalized_attention(q: torch.Tensor, k: torch.Tensor, probe_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """ZipCache's saliency of each key of S blocks. q: [S, P, Hq, D] probe queries, where probe p sits at block
    offset p and sees keys 0..p (``probe_valid`` [S, P]: present); k: [S, bs, Hkv, D]. Returns [S, Hkv, bs]: the
    attention each key receives from the probes that see it, divided by their number, averaged over the query
    heads of its group. The softmax runs over the block's keys only: for one query this keeps the ranking of the
    block's keys under the full softmax (same denominator), it only reweights queries against each other."""
    S, P, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    kk = k.float().repeat_interleave(Hq // Hkv, dim=2)                             # [S, bs, Hq, D]
    logits = torch.einsum("sphd,skhd->shpk", q.float(), kk) * scale                # [S, Hq, P, bs]
    sees = torch.arange(bs, device=q.device)[None, :] <= torch.arange(P, device=q.device)[:, None]   # [P, bs]
    sees = sees[None] & probe_valid[:, :, None]                                     # [S, P, bs]
    logits = logits.masked_fill(~sees[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)                          # rows of absent probes: 0
    received = probs.sum(dim=2)                                                     # [S, Hq, bs]
    count = sees.sum(dim=1).clamp_(min=1)                                           # [S, bs]
    score = received / count[:, None]
    return score.view(S, Hkv, Hq // Hkv, bs).mean(dim=2)


def top_salient(score: torch.Tensor, n: int) -> torch.Tensor:
    """[S, Hkv, bs] saliency -> [S, n, Hkv] offsets of the n most salient tokens per (block, head), ascending;
    ties go to the earlier token (a stable sort), so the choice is deterministic."""
    order = torch.sort(-score, dim=-1, stable=True).indices[..., :n]
    return order.sort(dim=-1).values.transpose(1, 2).to(torch.uint8)
