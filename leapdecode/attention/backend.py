"""The attention seam: what every backend receives for one step, and how a backend is chosen.

One step's tokens are a flat ragged batch. Sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``
and, after this step's keys are written, has ``seq_lens[i]`` keys in the paged cache, reachable through
``block_tables[i]``. ``positions`` are the tokens' positions (also used for causality, so token-tree drafts work:
a tree node sits at position base + depth). A sequence whose chunk ends in a token tree has a ``[q_len, q_len]``
visibility matrix over this step's tokens (committed tokens causal, a draft node sees its ancestors and itself),
stored flat in ``tree_mask`` from ``tree_offsets[i]`` (-1: no tree); all earlier keys are always visible.
Tokens past ``num_actual_tokens`` are padding (a capacity bucket): they belong to no sequence and write nowhere.

Per step the runner calls ``backend.plan(meta)`` once; the backend derives whatever it needs (index tensors, masks,
kernel splits) and keeps it in ``meta.plan``, which every layer's ``write_kv``/``attend`` then reuses. Nothing is
rebuilt per layer, and nothing lives in a global context: the metadata is passed to every layer explicitly.

A quantized cache (``kv_cache_dtype``) hands each layer a view object instead of a tensor (``kv_cache.py``); a
backend lists the formats it can read in ``kv_cache_dtypes``. For a windowed cache (int8/int4, fp8 keeping recent
tokens) the metadata also says where each token goes (``kv_write``: a full-precision window block, or the stage of
a block sealed this step), how each block is read (``kv_window``) and which blocks each layer quantizes after
writing and before attending (``kv_seal``): a block is read quantized from the step in which its last token
becomes final (and lies ``kv_cache_recent_tokens`` behind its sequence's end).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from leapdecode.attention.sparse import SparseAttention


@dataclass
class SealPlan:
    """The blocks a step seals (quantizes), planned once for every layer (windowed caches, see ``kv_cache.py``)."""
    blocks: torch.Tensor         # [S] pool blocks
    window: torch.Tensor         # [S] the window block that held their earlier tokens (-1: all tokens are new)
    stage_index: torch.Tensor    # [R] tile position (s * block_size + offset) of each of the step's tokens below
    stage_rows: torch.Tensor     # [R] their rows in the step's flat batch
    probes: torch.Tensor         # [S, block_size] query rows for the saliency probe (-1: none), by block offset


@dataclass
class CpuStep:
    """What the one-call decoder layer (model/cpu_layer.py) takes for a step: the positions, the slots written and
    each attention group's tensors (``TorchAttention._cpu_step``). Where the step has sparse decode rows, the
    layers from ``sparse_from`` on take ``sparse`` (those rows attended by their top positions) and the layers
    below take ``tensors`` (the same rows attended fully). ``windowed``: the tensors are for a windowed quantized
    cache (int8 / int4, fp8 with recent tokens; the slots written are window slots, each group carries its window
    map), else for a float32 cache."""

    tensors: list[torch.Tensor]
    sparse: list[torch.Tensor] | None = None
    sparse_from: int = 0
    windowed: bool = False

    def for_layer(self, layer: int | None) -> list[torch.Tensor]:
        use_sparse = self.sparse is not None and layer is not None and layer >= self.sparse_from
        return self.sparse if use_sparse else self.tensors


@dataclass
class AttentionMetadata:
    positions: torch.Tensor           # [T] int64
    slot_mapping: torch.Tensor        # [T] int64, flat slot index in the cache (block * block_size + offset)
    block_tables: torch.Tensor        # [B, max_blocks] (unused entries are 0)
    seq_lens: torch.Tensor            # [B], keys per sequence after this step
    query_start_loc: torch.Tensor     # [B + 1]
    query_lens: list[int]             # host copies, to plan without device syncs
    seq_lens_host: list[int]
    block_size: int
    num_actual_tokens: int
    sliding_window: int | None = None
    tree_mask: torch.Tensor | None = None      # flat bool, see the module docstring
    tree_offsets: torch.Tensor | None = None   # [B] int64, -1: no tree
    tree_offsets_host: list[int] | None = None
    # windowed caches only (int8/int4, fp8 with recent tokens): where each token is written, how each block is read
    kv_write: torch.Tensor | None = None       # [T] window slot of each token (-1: a sealed block, or the stage)
    kv_window: torch.Tensor | None = None      # [B, max_blocks] window block of an open block (-1: read the pool's)
    kv_seal: SealPlan | None = None            # blocks each layer quantizes after its write, before it attends
    plan: Any = None                  # the backend's per-step plan, set by ``AttentionBackend.plan``
    # set by the plan where one C++ call may run a whole decoder layer (model/cpu_layer.py)
    cpu_step: CpuStep | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def tree(self, i: int) -> torch.Tensor | None:
        """Sequence i's [q_len, q_len] tree visibility, or None."""
        if self.tree_offsets_host is None or self.tree_offsets_host[i] < 0:
            return None
        o, q = self.tree_offsets_host[i], self.query_lens[i]
        return self.tree_mask[o:o + q * q].view(q, q)


class AttentionBackend(ABC):
    """Plans a step once, then for each layer writes the step's keys/values into the paged cache and attends."""
    name = "base"
    kv_cache_dtypes: tuple[str, ...] = ("auto",)    # the KV formats it reads (see kv_quant.py), windowed or not

    def plan(self, meta: AttentionMetadata) -> None:
        """Derive per-step data shared by every layer and store it in ``meta.plan`` (called once per step)."""

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 layer: int | None = None) -> None:
        """k, v: [T, Hkv, D] -> stored at ``meta.slot_mapping`` (padding tokens write nowhere); ``layer``: the
        layer's index (sparse attention keeps per-layer bounds of what was written)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               layer: int | None = None) -> torch.Tensor:
        """q: [T, H, D] -> [T, H, D] (rows of padding tokens are left undefined). ``layer``: the model layer's
        index, which only sparse attention reads (its selection layers differ from the others)."""


BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str = "auto", device: torch.device | None = None,
                sparse: SparseAttention | None = None, exact: str = "off") -> AttentionBackend:
    """"torch": the portable reference backend; "triton": the Triton GPU kernels (CUDA only).
    "auto": on CUDA the Triton kernels (verified on an H200 against float64 and the torch backend; they are what
    CUDA graphs capture, and which decode every quantized ``kv_cache_dtype`` as they read), unless the step needs
    what only the torch backend does (``sparse`` decoding); elsewhere the torch backend.
    LEAPDECODE_ATTENTION_BACKEND=torch|triton overrides "auto".
    ``sparse``: lossy sparse decoding's settings (attention/sparse.py), which only the torch backend implements.
    ``exact``: batch-invariant attention ("kernel", the CPU's default, or "always"; ``TorchAttention``), which only
    the torch backend does; "always" picks it on CUDA too."""
    import os
    if name == "auto":
        on_cuda = device is not None and torch.device(device).type == "cuda"
        default = "triton" if on_cuda and sparse is None and exact != "always" else "torch"
        name = os.environ.get("LEAPDECODE_ATTENTION_BACKEND", default).strip().lower() or default
    if name == "torch":
        from leapdecode.attention.torch_ref import TorchAttention
        return TorchAttention(sparse, exact)
    if sparse is not None and name == "triton":
        raise ValueError("sparse_attention runs on the torch attention backend only (attention_backend='torch' or "
                         "'auto'): the Triton kernels have no sparse path yet")
    if exact == "always" and name == "triton":
        raise ValueError("batch_invariant=True (exact attention) runs on the torch attention backend only "
                         "(attention_backend='torch' or 'auto')")
    if name == "triton":
        if device is not None and torch.device(device).type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1)")
        from leapdecode.attention.triton_backend import TritonAttention
        return TritonAttention()
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
