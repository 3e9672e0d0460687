"""The paged KV pool of one model, as an object: its layout, its dtype and scales, and the copies that move KV around.

Layout (``kv_cache_dtype="auto"``, the model's dtype): ``[layers, 2 (keys, values), blocks, block_size, kv_heads,
head_dim]``; layer i's view is handed to the model's attention layer i. A slot is ``block * block_size + offset``.
Whoever copies KV goes through ``copy_slots`` so scales can never be forgotten.

Quantized formats (lossy, opt-in; the arithmetic is in ``kv_quant.py``):

- ``fp8``: the same layout in float8_e4m3fn codes (stored as uint8) and ``scales`` [layers, 2, blocks, block_size,
  kv_heads] (float16, one per token and head). With ``recent_tokens`` = 0 a token is encoded when it is written;
  otherwise blocks are sealed like int8's (below) and encoded token by token when they seal.
- ``int8`` / ``int4``: a block's keys are quantized per channel, so a block is only quantized ("sealed") once all
  of its tokens are final, and (``recent_tokens``) once it lies that many tokens behind its sequence's end (the
  newest keys draw most of the attention: KIVI's full-precision residual). Until then it lives in the **window**:
  ``window_blocks`` full-precision blocks ``[layers, 2, window_blocks + 1, block_size, kv_heads, head_dim]`` holding
  every sequence's open blocks (the partial last block, blocks holding draft tokens, and the recent ones; the
  spare last block takes the writes of tokens that go elsewhere, so a write never syncs the host). The
  block manager hands out window blocks with pool blocks and the scheduler says which blocks seal in each step
  (``engine/block_manager.py``). A pool block stores codes
  ``[layers, 2, blocks, block_size, kv_heads, head_dim * bits / 8]``, the keys' per-channel grids ``[layers,
  blocks, 2 (zero, step), kv_heads, head_dim]`` and the values' per-token grids ``[layers, blocks, 2, block_size,
  kv_heads]`` (float16), and for int4 with salient tokens their offsets ``[layers, blocks, n, kv_heads]`` and low
  nibbles ``[layers, 2, blocks, n, kv_heads, head_dim / 2]``. ``bytes_per_block`` counts all of it, so the pool
  sizing gives more blocks for the same memory. ``copy_slots`` moves window slots (only open blocks ever move).

``read_blocks``/``write_blocks`` copy whole pool blocks, every plane of the format (``planes``), to and from CPU
tensors: the KV transfer between engines (``engine/kv_transfer.py``), bit-exact in every format.

On CPU every tensor is an anonymous private mapping of zero pages that the kernel maps on first write (as
transparent huge pages where offered), so a large pool costs no memory at start-up and only the blocks actually used
ever become resident; the first page of every plane is written at start-up (see ``_zeros``).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from leapdecode.attention import kv_quant as kq

if TYPE_CHECKING:
    from leapdecode.attention.backend import SealPlan


@dataclass(frozen=True)
class KVLayout:
    """What a block of KV costs: the format, the model's KV shape and its full-precision dtype."""
    kv_cache_dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_salient: int = 0          # int4: tokens per block (per kv head) that keep 8-bit precision
    recent_tokens: int = 0        # each sequence's newest tokens kept at full precision (in the window)

    @property
    def lossy(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def windowed(self) -> bool:
        """Blocks are quantized when they fill (and lie ``recent_tokens`` behind); until then they live in a
        full-precision window. int8/int4 always (their keys are quantized per channel over a block); fp8 when
        it keeps recent tokens."""
        return self.kv_cache_dtype in ("int8", "int4") or (self.kv_cache_dtype == "fp8" and self.recent_tokens > 0)

    @property
    def recent_blocks(self) -> int:
        """Window blocks a sequence holds for its recent tokens, beyond its open block."""
        return -(-self.recent_tokens // self.block_size) if self.windowed else 0

    @property
    def bits(self) -> int:
        return {"auto": 8 * self.dtype.itemsize, "fp8": 8, "int8": 8, "int4": 4}[self.kv_cache_dtype]

    @property
    def storage(self) -> str:
        """The name of what a pool block holds: the model's dtype, or the quantized format."""
        if self.kv_cache_dtype == "auto":
            return str(self.dtype).replace("torch.", "")
        return "fp8_e4m3" if self.kv_cache_dtype == "fp8" else self.kv_cache_dtype

    @property
    def window_bytes_per_block(self) -> int:
        """One block at full precision (the model's dtype): the pool's block under "auto", a window block otherwise."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """One pool block, scales included."""
        L, bs, h, d = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        if self.kv_cache_dtype == "auto":
            return self.window_bytes_per_block
        codes = 2 * bs * h * d * self.bits // 8
        if self.kv_cache_dtype == "fp8":
            return L * (codes + 2 * bs * h * 2)                       # + a float16 scale per token and head
        grids = 2 * h * d * 2 + 2 * bs * h * 2                       # float16 (zero, step): keys, values
        salient = self.num_salient * h + 2 * self.num_salient * h * d // 2
        return L * (codes + grids + salient)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto", window_blocks: int = 0,
                 num_salient: int = 0, recent_tokens: int = 0) -> None:
        fmt = kq.parse_kv_cache_dtype(kv_cache_dtype)
        self.layout = KVLayout(fmt, num_layers, block_size, num_kv_heads, head_dim, dtype,
                               num_salient if fmt == "int4" else 0, recent_tokens if fmt != "auto" else 0)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.window_blocks = window_blocks if self.layout.windowed else 0
        L, bs, h, d = num_layers, block_size, num_kv_heads, head_dim
        fmt = self.layout.kv_cache_dtype
        if fmt == "auto":
            self.data = _zeros((L, 2, num_blocks, bs, h, d), dtype, device, 2)
            self.scales: torch.Tensor | None = None
        elif fmt == "fp8":
            self.data = _zeros((L, 2, num_blocks, bs, h, d), torch.uint8, device, 2)
            self.scales = _zeros((L, 2, num_blocks, bs, h), torch.float16, device, 2)
        else:
            if d % 2:
                raise ValueError(f"kv_cache_dtype={fmt!r} needs an even head_dim, got {d}")
            n = self.layout.num_salient
            self.data = _zeros((L, 2, num_blocks, bs, h, d * self.layout.bits // 8), torch.uint8, device, 2)
            self.scales = None
            self.key_grid = _zeros((L, num_blocks, 2, h, d), torch.float16, device, 1)
            self.value_grid = _zeros((L, num_blocks, 2, bs, h), torch.float16, device, 1)
            self.salient = _zeros((L, num_blocks, n, h), torch.uint8, device, 1)
            self.residual = _zeros((L, 2, num_blocks, n, h, d // 2), torch.uint8, device, 2)
        if self.layout.windowed:
            if self.window_blocks < 1:
                raise ValueError(f"kv_cache_dtype={fmt!r} needs at least one full-precision window block")
            # one spare block past the window: the write's dump for tokens that go elsewhere (never read)
            self.window = _zeros((L, 2, self.window_blocks + 1, bs, h, d), dtype, device, 2)
            self._stage = _Stage()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """A full-precision block (``KVLayout.bytes_per_block`` prices the others)."""
        return KVLayout("auto", num_layers, block_size, num_kv_heads, head_dim, dtype).bytes_per_block

    @property
    def nbytes(self) -> int:
        """Bytes of the pool, scales and window included."""
        window = self.window_blocks + 1 if self.layout.windowed else 0       # (the spare block included)
        return self.num_blocks * self.layout.bytes_per_block + window * self.layout.window_bytes_per_block

    def layer(self, i: int) -> "torch.Tensor | Fp8Layer | WindowedLayer":
        """Layer i's cache: a [2, blocks, block_size, kv_heads, head_dim] tensor under "auto", else the layer's view
        of the quantized storage (the attention backend dispatches on the type)."""
        fmt = self.layout.kv_cache_dtype
        if fmt == "auto":
            return self.data[i]
        if not self.layout.windowed:
            return Fp8Layer(self.data[i], self.scales[i], self.dtype)
        if fmt == "fp8":
            return WindowedLayer(self.layout, self.data[i], self.window[i], self._stage, scales=self.scales[i])
        return WindowedLayer(self.layout, self.data[i], self.window[i], self._stage, self.key_grid[i],
                             self.value_grid[i], self.salient[i], self.residual[i])

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV at slots ``src`` to slots ``dst`` in every layer (all reads happen before any write). In a
        windowed cache the slots are window slots: only open (full-precision) blocks ever move (tree compaction,
        the partial block of a beam fork); a sealed block is shared by reference, never copied."""
        store = self.window if self.layout.windowed else self.data
        L, _, nb, bs, h, d = store.shape
        flat = store.view(L, 2, nb * bs, h, d)
        flat[:, :, dst] = flat[:, :, src].clone()
        if self.layout.kv_cache_dtype == "fp8" and not self.layout.windowed:
            scales = self.scales.view(L, 2, nb * bs, h)
            scales[:, :, dst] = scales[:, :, src].clone()

    def keys_at(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s keys [n, kv_heads, head_dim] at ``slots`` in the model's dtype: pool slots, or in a
        windowed cache window slots (what ``copy_slots`` moves)."""
        h, d = self.num_kv_heads, self.head_dim
        if self.layout.windowed:
            return self.window[layer, 0].reshape(-1, h, d)[slots]
        if self.layout.kv_cache_dtype == "fp8":
            return kq.fp8_decode(self.data[layer, 0].reshape(-1, h, d)[slots],
                                 self.scales[layer, 0].reshape(-1, h)[slots], self.dtype)
        return self.data[layer, 0].reshape(-1, h, d)[slots]

    @torch.inference_mode()
    def seal_from_window(self, blocks: torch.Tensor, windows: torch.Tensor) -> None:
        """Quantize window blocks ``windows`` [S] into pool ``blocks`` [S] in every layer at once: a step's deferred
        seals (scheduler: a decode step's filled blocks, after its forward) and the late seals of a finished
        sequence's recent blocks. With salient tokens there is no query to probe them with, so each head keeps
        the tokens with the largest keys (L2 norm) at 8 bits. The same values as sealing layer by layer."""
        if not len(blocks):
            return
        L, S = self.num_layers, len(blocks)
        tile = self.window[:, :, windows].float()                             # [L, 2, S, bs, h, d]
        k, v = tile[:, 0].flatten(0, 1), tile[:, 1].flatten(0, 1)           # [L * S, bs, h, d]
        salient = None
        if self.layout.num_salient:
            salient = kq.top_salient(k.norm(dim=-1).transpose(1, 2), self.layout.num_salient)
        store = {name: (t, axis) for name, t, axis in self.planes()}
        for name, (x, axis) in quantize_tiles(self.layout, k, v, salient).items():
            x = x.unflatten(axis, (L, S)).movedim(axis, 0)                    # layers first, blocks at axis + 1
            store[name][0].movedim(store[name][1], 1)[:, blocks] = x.movedim(axis + 1, 1)

    def planes(self) -> tuple[tuple[str, torch.Tensor, int], ...]:
        """Every pool tensor that holds part of a block's KV, as (name, tensor, block axis): the codes and whatever
        decoding them needs. The window is not among them: only sealed blocks are read or written whole."""
        fmt = self.layout.kv_cache_dtype
        if fmt == "auto":
            return (("data", self.data, 2),)
        if fmt == "fp8":
            return (("codes", self.data, 2), ("scales", self.scales, 2))
        return (("codes", self.data, 2), ("key_grid", self.key_grid, 1), ("value_grid", self.value_grid, 1),
                ("salient", self.salient, 1), ("residual", self.residual, 2))

    @torch.no_grad()
    def read_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Pool blocks as CPU tensors, one tuple per block with one tensor per plane (the plane's shape without its
        block axis). Each tensor owns its storage, so pickling a block ships that block and nothing else."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        gathered = [t.movedim(axis, 0)[idx].cpu() for _, t, axis in self.planes()]     # one copy per plane
        return [tuple(g[i].clone() for g in gathered) for i in range(len(blocks))]

    @torch.no_grad()
    def write_blocks(self, blocks: list[int], data: list[tuple[torch.Tensor, ...]]) -> None:
        """The inverse of ``read_blocks``: a bit-exact copy of each block's planes into pool ``blocks``. Every
        shape and dtype is checked before anything is written (ValueError naming the plane)."""
        planes = self.planes()
        if len(blocks) != len(data):
            raise ValueError(f"{len(data)} blocks of KV for {len(blocks)} pool blocks")
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"pool blocks out of range: {bad[:5]}")
        for block in data:
            if len(block) != len(planes):
                raise ValueError(f"a block of KV has {len(block)} planes; this cache's blocks have {len(planes)} "
                                 f"({', '.join(name for name, _, _ in planes)})")
            for part, (name, t, axis) in zip(block, planes):
                want = t.shape[:axis] + t.shape[axis + 1:]
                if part.shape != want or part.dtype != t.dtype:
                    raise ValueError(f"a block's {name} is {tuple(part.shape)} {part.dtype}; this cache expects "
                                     f"{tuple(want)} {t.dtype}")
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for i, (_, t, axis) in enumerate(planes):
            t.movedim(axis, 0)[idx] = torch.stack([block[i] for block in data]).to(self.device)


@dataclass
class Fp8Layer:
    """One layer of an fp8 cache: codes [2, blocks, block_size, kv_heads, head_dim] and their per-token scales
    [2, blocks, block_size, kv_heads]."""
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        _, nb, bs, h, d = self.codes.shape
        codes, scales = self.codes.view(2, nb * bs, h, d), self.scales.view(2, nb * bs, h)
        for i, x in enumerate((k, v)):
            c, s = kq.fp8_quantize(x)
            codes[i].index_copy_(0, slots, c)
            scales[i].index_copy_(0, slots, s)

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [B, nb] -> keys, values [B, nb * block_size, kv_heads, head_dim] in the model's dtype."""
        return tuple(kq.fp8_decode(self.codes[i][blocks].flatten(1, 2), self.scales[i][blocks].flatten(1, 2),
                                   self.dtype) for i in (0, 1))


class _Stage:
    """The full-precision tiles of the blocks being sealed in the current layer (shared by all layers: a layer
    fills it in ``write`` and empties it in ``seal``)."""
    tile: torch.Tensor | None = None


@dataclass
class WindowedLayer:
    """One layer of a windowed cache (int8/int4, or fp8 keeping recent tokens): pool blocks of codes and what
    decodes them, and the full-precision window of every sequence's open and recent blocks."""
    layout: KVLayout
    codes: torch.Tensor                      # [2, blocks, bs, h, d * bits / 8] uint8
    window: torch.Tensor                     # [2, window_blocks, bs, h, d] model dtype
    stage: _Stage
    key_grid: torch.Tensor | None = None     # int: [blocks, 2, h, d] float16 (zero, step)
    value_grid: torch.Tensor | None = None   # int: [blocks, 2, bs, h] float16
    salient: torch.Tensor | None = None      # int4: [blocks, n, h] uint8 offsets
    residual: torch.Tensor | None = None     # int4: [2, blocks, n, h, d / 2] uint8 low nibbles
    scales: torch.Tensor | None = None       # fp8: [2, blocks, bs, h] float16, one per token and head

    def write(self, k: torch.Tensor, v: torch.Tensor, window_slots: torch.Tensor, seal: "SealPlan | None") -> None:
        """Store the step's keys/values: tokens of open blocks into the window (``window_slots``, -1: elsewhere),
        tokens of blocks sealed this step into the stage, over what the window already held of those blocks."""
        _, nw, bs, h, d = self.window.shape
        flat = self.window.view(2, nw * bs, h, d)
        # tokens that go elsewhere land in the spare last block: no host sync to pick them out
        slots = torch.where(window_slots >= 0, window_slots, (nw - 1) * bs)
        flat[0].index_copy_(0, slots, k.to(self.window.dtype))
        flat[1].index_copy_(0, slots, v.to(self.window.dtype))
        if seal is None:
            return
        tile = self.window[:, seal.window.clamp(min=0)].float()                        # [2, S, bs, h, d]
        tile = torch.where((seal.window >= 0)[None, :, None, None, None], tile, 0.0)
        tile = tile.reshape(2, -1, h, d)
        tile[0].index_copy_(0, seal.stage_index, k[seal.stage_rows].float())
        tile[1].index_copy_(0, seal.stage_index, v[seal.stage_rows].float())
        self.stage.tile = tile.view(2, -1, bs, h, d)

    def staged_keys(self) -> torch.Tensor:
        """The keys of the blocks being sealed, [S, bs, h, d] float32 (for the saliency probe)."""
        return self.stage.tile[0]

    def seal(self, blocks: torch.Tensor, salient: torch.Tensor | None) -> None:
        """Quantize the staged tiles into pool ``blocks`` [S]; int4 keeps ``salient`` ([S, n, h] offsets) at 8 bits."""
        tile, self.stage.tile = self.stage.tile, None
        for name, (x, axis) in quantize_tiles(self.layout, tile[0], tile[1], salient).items():
            getattr(self, name).movedim(axis, 0)[blocks] = x.movedim(axis, 0)     # (planes are named as fields)

    def read(self, blocks: torch.Tensor, window: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [B, nb] (with ``window`` [B, nb]: the window block of an open block, -1: read the pool block) ->
        keys, values [B, nb * bs, h, d] in the model's dtype: sealed blocks dequantized, open ones as written."""
        k, v = self._decode(blocks)
        if window is not None:
            open_ = window >= 0
            if bool(open_.any()):
                # open blocks trail each table (sealed ones are a prefix): only the columns from the first open
                # one on are overlaid, not the whole context
                first = int(open_.any(0).nonzero()[0])
                win, sel = window[:, first:], open_[:, first:, None, None, None]
                w = self.window[:, win.clamp(min=0)]                                 # [2, B, nb - first, bs, h, d]
                k[:, first:] = torch.where(sel, w[0], k[:, first:])
                v[:, first:] = torch.where(sel, w[1], v[:, first:])
        return k.flatten(1, 2), v.flatten(1, 2)

    def _decode(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool blocks [B, nb] dequantized: keys, values [B, nb, bs, h, d] in the model's dtype."""
        dtype = self.window.dtype
        if self.scales is not None:
            return tuple(kq.fp8_decode(self.codes[i][blocks], self.scales[i][blocks], dtype) for i in (0, 1))
        kg, vg = self.key_grid[blocks], self.value_grid[blocks]                     # [B, nb, 2, ...]
        if self.layout.bits == 8:
            ku, vu = self.codes[0][blocks], self.codes[1][blocks]
        else:
            B, nb = blocks.shape
            flat = blocks.reshape(-1)
            sal = self.salient[flat] if self.layout.num_salient else None
            ku = kq.int4_units(kq.unpack_nibbles(self.codes[0][flat]),
                               kq.unpack_nibbles(self.residual[0][flat]) if sal is not None else None, sal)
            vu = kq.int4_units(kq.unpack_nibbles(self.codes[1][flat]),
                               kq.unpack_nibbles(self.residual[1][flat]) if sal is not None else None, sal)
            ku, vu = ku.view(B, nb, *ku.shape[1:]), vu.view(B, nb, *vu.shape[1:])
        k = kq.decode_units(ku, kg[:, :, 0, None], kg[:, :, 1, None]).to(dtype)
        v = kq.decode_units(vu, vg[:, :, 0, ..., None], vg[:, :, 1, ..., None]).to(dtype)
        return k, v


def quantize_tiles(layout: KVLayout, k: torch.Tensor, v: torch.Tensor, salient: torch.Tensor | None
                   ) -> dict[str, tuple[torch.Tensor, int]]:
    """Full-precision tiles of N blocks (keys, values [N, bs, h, d]) as the planes a pool block stores, each
    ``name -> (tensor, block axis)`` shaped like the layer's plane with N blocks; int4 keeps ``salient`` ([N, n, h]
    offsets) at 8 bits. Every value depends only on its own block, so N may span blocks of several layers."""
    if layout.kv_cache_dtype == "fp8":                                    # token by token
        (kc, ks), (vc, vs) = kq.fp8_quantize(k), kq.fp8_quantize(v)
        return {"codes": (torch.stack((kc, vc)), 1), "scales": (torch.stack((ks, vs)), 1)}
    kz, kst = kq.key_grid(k)
    vz, vst = kq.value_grid(v)
    planes = {"key_grid": (torch.stack((kz[:, 0], kst[:, 0]), dim=1), 0),
              "value_grid": (torch.stack((vz[..., 0], vst[..., 0]), dim=1), 0)}
    if layout.bits == 8:
        planes["codes"] = (torch.stack((kq.encode_units(k, kz, kst, 8), kq.encode_units(v, vz, vst, 8))), 1)
        return planes
    kc, kr = kq.encode_int4(k, kz, kst, salient)
    vc, vr = kq.encode_int4(v, vz, vst, salient)
    planes["codes"] = (torch.stack((kq.pack_nibbles(kc), kq.pack_nibbles(vc))), 1)
    if kr is not None:
        planes["salient"] = (salient, 0)
        planes["residual"] = (torch.stack((kq.pack_nibbles(kr), kq.pack_nibbles(vr))), 1)
    return planes


def _fresh_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes in an anonymous private mapping of their own: its pages are mapped as they are first
    written (a large pool costs no memory until used), as transparent huge pages where the system offers them
    (decode attention read its keys 17-27% faster from huge pages than from 4 KiB ones, session 37). Not calloc: in
    the test suite's long-lived process a calloc'd 48 MB pool came back with every page mapped (calloc may hand
    back memory it zeroed itself). Elsewhere (no ``MAP_PRIVATE``, e.g. Windows), numpy's zeros."""
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):
        return np.zeros(nbytes, dtype=np.uint8)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(mapping, dtype=np.uint8)          # (the array holds the mapping; freed with it)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, block_axis: int) -> torch.Tensor:
    """Zeros of ``shape`` whose axis ``block_axis`` numbers the pool's blocks. On the CPU: fresh pages
    (:func:`_fresh_pages`), mapped as blocks are first written, except the first page of every plane (the dimensions
    before ``block_axis``: a layer's keys, its values, ...), written now. Why: the first write into each 2 MiB huge
    page maps and zeroes it, ~4-6 ms on the 2-core VM (a fresh 1 GiB array: 2.2 s for a byte in each of its 512
    huge pages, 8 ms for all its other pages after). The default model's first request wrote its first keys and
    values into 60 planes and spent ~0.4 s of its ~0.47 s there (the first answer of ``make demo``); with each
    plane's first page written at start-up, ~0.11 s (start-up ~0.3 s longer: the same time before a one-shot
    generate's answer, none of it in a chat's or a server's first request). Later blocks map their pages as they
    come (a page beyond a plane's first huge page the first time)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = _fresh_pages(max(nbytes, 1))
    planes = int(np.prod(shape[:block_axis]))
    if nbytes and planes:
        buf[:nbytes].reshape(planes, nbytes // planes)[:, 0] = 0       # each plane's first page (see above)
    return torch.from_numpy(buf)[:nbytes].view(dtype).view(shape)
