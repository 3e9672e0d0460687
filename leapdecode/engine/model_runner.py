"""Owns the model, the KV cache and the input buffers; turns a step plan into one forward pass and logits rows.

This is the executor the engine talks to (see ``engine/executor.py``): it sees only the plan's plain data, never a
live ``Sequence``. Logits are computed only where a next token is needed: the rows a sequence samples (the last
token of its chunk and each draft node) and, when asked, every prompt position for prompt logprobs.

Under tensor parallelism every rank has a runner over its shard (engine/tp_executor.py): the same plan, the same
forward, its own KV heads in its own pool; rank 0 gets the logits (the others get ``logits=None``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from leapdecode.attention.backend import get_backend
from leapdecode.attention.kv_cache import KVCache, KVLayout
from leapdecode.config import EngineConfig
from leapdecode.distributed.parallel_state import SINGLE, ParallelState
from leapdecode.engine.cuda_graphs import CudaGraphs
from leapdecode.engine.input_batch import ForwardBatch, InputBuffers
from leapdecode.engine.step import StepPlan
from leapdecode.model import cpu_layer
from leapdecode.model.config import ModelConfig
from leapdecode.model.loader import load_model
from leapdecode.model.int4_linear import quantize_model
from leapdecode.model.packed_linear import pack_model
from leapdecode.model.parallel_layers import head_shard

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from leapdecode.attention.sparse import SparseAttention

CPU_KV_CAP = 2 << 30    # CPU default: at most 2 GiB of KV (pages are only touched when used)


@dataclass
class ForwardOutput:
    logits: torch.Tensor                                    # [R, vocab] float32 (None on ranks > 0 of a TP group)
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)   # HF numbering, rows as ``logits``


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, max_model_len: int,
                 tp: ParallelState = SINGLE, agree_blocks: Callable[[int], int] | None = None) -> None:
        """``tp``: this runner's rank in a tensor-parallel group (it loads its shard, its KV pool holds its KV
        heads); ``agree_blocks``: turns this rank's KV block count into the group's (every rank the same pool)."""
        self.cfg, self.model_cfg, self.dtype, self.tp = cfg, model_cfg, dtype, tp
        self.device = cfg.torch_device
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        c = self._kv_view = replace(model_cfg, num_kv_heads=head_shard(model_cfg, tp).num_kv_heads)
        self.kv_layout = KVLayout(cfg.kv_cache_dtype, c.num_layers, self.block_size, c.num_kv_heads, c.head_dim,
                                  dtype, cfg.kv_cache_salient_tokens, cfg.kv_cache_recent_tokens)
        self.backend = get_backend(cfg.attention_backend, self.device, _sparse_attention(cfg, model_cfg),
                                   exact=cfg.exact_attention)
        self.model = load_model(cfg.model, model_cfg, self.backend, dtype, self.device, max_model_len, tp,
                                cfg.load_format, cfg.seed)
        # quantize first: packing a weight for oneDNN only to unpack and quantize it was work (and memory) twice
        self.quantized = quantize_model(self.model, cfg.quantization)    # counts; all zero without quantization
        self.num_packed_linears = pack_model(self.model, cfg.cpu_packed_linears,   # the float layers left
                                             activations="int8" if cfg.quantization == "int8_activations"
                                             else "float32")
        # blocks past the block manager's pool, written only by a drafter that runs the target itself
        # (spec/layer_skip.py, spec/kangaroo.py), so draft KV never lands in a slot the target owns
        self.num_scratch_blocks = _scratch_blocks(cfg)
        self._check_kv_format()
        self.num_blocks, self.num_window_blocks = self._num_blocks(max_model_len)
        if agree_blocks is not None:
            self.num_blocks = agree_blocks(self.num_blocks)
        # a windowed cache has one more pool block that nothing reads: CUDA graphs' padding seals write it
        self.trash_block = self.num_blocks + self.num_scratch_blocks if self.kv_layout.windowed else None
        self.kv_cache = KVCache(c.num_layers, self.num_blocks + self.num_scratch_blocks
                                + (self.trash_block is not None), self.block_size,
                                c.num_kv_heads, c.head_dim, dtype, self.device, cfg.kv_cache_dtype,
                                self.num_window_blocks, cfg.kv_cache_salient_tokens, cfg.kv_cache_recent_tokens)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache.layer(i)
        self.buffers = InputBuffers(self.device, windowed=self.kv_layout.windowed)
        self.pad = cfg.pad_to_buckets if cfg.pad_to_buckets is not None else self.device.type == "cuda"
        self.graphs = self._cuda_graphs()
        self.last_graph: tuple[int, int] | None = None   # the graph bucket the last step replayed (its timing key)
        # a windowed cache on the CPU seals the blocks a decode step fills after its forward (block_manager.py),
        # so such steps stay on the one-call decoder layer; salient tokens are chosen by the step's own queries
        # inside the layer. (On a GPU the seal rides inside the step's CUDA graph.)
        self.defer_seals = (self.kv_layout.windowed and self.device.type == "cpu"
                            and not self.kv_layout.num_salient)

    def _cuda_graphs(self) -> CudaGraphs | None:
        """CUDA graphs for decode and verification steps (engine/cuda_graphs.py), captured now; None where they do
        not apply: not CUDA, ``enforce_eager``, the torch attention backend (its plan reads host data), tensor
        parallelism, or a drafter that runs the target itself (layer skipping). A windowed KV cache's graphs come in
        pairs (steps that seal blocks and steps that do not, see engine/cuda_graphs.py)."""
        cfg = self.cfg
        if (cfg.enforce_eager or cfg.max_graph_batch == 0 or self.device.type != "cuda" or self.tp.size > 1
                or not hasattr(self.backend, "plan_graph") or self.num_scratch_blocks):
            return None
        spec = cfg.speculative_config
        query_lens = (1,) + ((spec.num_speculative_tokens + 1,) if spec is not None else ())
        graphs = CudaGraphs(self.model, self.backend, self.device, self.block_size, self.max_model_len,
                            self.model_cfg.sliding_window, min(cfg.max_graph_batch, cfg.max_num_seqs), query_lens,
                            trash_block=self.trash_block)
        try:
            graphs.capture()
        except Exception:    # noqa: BLE001 - a windowed cache's sealing graphs are newer: eager beats no engine
            if self.trash_block is None:
                raise
            log.exception("capturing the windowed KV cache's CUDA graphs failed; its steps run eagerly")
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    @property
    def _pages(self) -> SparseAttention | None:
        """Sparse decoding's settings when it selects by page (and keeps per-block key bounds), else None."""
        sparse = getattr(self.backend, "sparse", None)
        return sparse if sparse is not None and sparse.pages else None

    @property
    def page_bounds_per_block(self) -> int:
        """Bytes sparse decoding's page selection keeps per block beside its KV (each selecting layer's per-channel
        key minimum and maximum, float32); 0 otherwise. Counted in the KV budget."""
        sparse = self._pages
        if sparse is None:
            return 0
        return 2 * len(sparse.selection_layers) * self._kv_view.num_kv_heads * self._kv_view.head_dim * 4

    @property
    def kv_bytes_per_block(self) -> int:
        """A pool block's real size (quantized codes and their scales for a lossy ``kv_cache_dtype``)."""
        return self.kv_layout.bytes_per_block

    def _check_kv_format(self) -> None:
        fmt = self.kv_layout.kv_cache_dtype
        if fmt not in self.backend.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype={fmt!r} is read by the torch attention backend only (dequantization "
                             f"is not fused into the {self.backend.name} kernels for it yet): use "
                             "attention_backend='torch'")
        if self.kv_layout.windowed and self.num_scratch_blocks:
            raise ValueError(f"kv_cache_dtype={fmt!r} with a full-precision window does not work with layer_skip "
                             "or kangaroo speculation (its draft KV is written past the pool, outside the window): "
                             "use auto, or fp8 with kv_cache_recent_tokens=0")

    def _window_wanted(self) -> tuple[int, int]:
        """Windowed caches: (window blocks for every sequence's open blocks, the fewest one sequence needs): a
        sequence has one partial block open, plus those its draft tokens reach and those of its recent tokens."""
        if not self.kv_layout.windowed:
            return 0, 0
        spec = self.cfg.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        per_seq = min(1 + -(-k // self.block_size) + self.kv_layout.recent_blocks,
                      -(-(self.max_model_len + k) // self.block_size))     # never more than a whole sequence
        return self.cfg.max_num_seqs * per_seq, per_seq

    def _num_blocks(self, max_model_len: int) -> tuple[int, int]:
        """(pool blocks, full-precision window blocks). A windowed cache gives its window at most a quarter of the
        budget; the pool gets the rest at its real (quantized) block size."""
        want, least = self._window_wanted()
        window_bytes = self.kv_layout.window_bytes_per_block
        if self.cfg.num_kv_blocks is not None:
            blocks = self.cfg.num_kv_blocks
            window = min(want, max(least, blocks))
        else:
            budget = self.cfg.kv_cache_memory
            if budget is None:
                budget = self._default_kv_budget(max_model_len, want)
            window = min(want, max(least, budget // (4 * window_bytes)))
            blocks = max(0, budget - window * window_bytes) // (self.kv_bytes_per_block + self.page_bounds_per_block)
        need = -(-max_model_len // self.block_size)
        if blocks < need:
            raise ValueError(
                f"the KV cache ({blocks} blocks of {self.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens ({need} blocks): raise kv_cache_memory or lower max_model_len")
        return blocks, window

    def _default_kv_budget(self, max_model_len: int, window: int = 0) -> int:
        """CUDA: 90% of what is free after the weights; CPU: room for max_num_seqs full sequences (and their open
        blocks' window), at most 2 GiB."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        window_bytes = window * self.kv_layout.window_bytes_per_block
        want = self.cfg.max_num_seqs * max_model_len // self.block_size * self.kv_bytes_per_block + window_bytes
        return max(min(want, CPU_KV_CAP),
                   -(-max_model_len // self.block_size) * self.kv_bytes_per_block + window_bytes)

    def kv_cache_info(self) -> dict:
        """What the KV cache holds and costs (see ``LLM.kv_cache_info``)."""
        lay = self.kv_layout
        full = lay.window_bytes_per_block
        return {
            "dtype": lay.storage, "kv_cache_dtype": lay.kv_cache_dtype, "lossy": lay.lossy,
            "num_blocks": self.num_blocks, "block_size": self.block_size, "max_tokens": self.num_blocks * self.block_size,
            "bytes_per_block": lay.bytes_per_block, "bytes_per_token": lay.bytes_per_block / self.block_size,
            "full_precision_bytes_per_token": full / self.block_size, "compression": full / lay.bytes_per_block,
            "num_window_blocks": self.num_window_blocks, "window_bytes": self.num_window_blocks * full,
            "page_bounds_bytes": self.num_blocks * self.page_bounds_per_block,
            "total_bytes": self.num_blocks * (lay.bytes_per_block + self.page_bounds_per_block)
            + self.num_window_blocks * full,
            "salient_tokens_per_block": lay.num_salient, "recent_tokens": lay.recent_tokens,
        }

    # -- one step ----------------------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """The plan's inputs in the persistent buffers (one host-to-device copy)."""
        return self.buffers.build(plan, self.model_cfg.sliding_window, self.pad,
                                  -(-self.max_model_len // self.block_size))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, batch: ForwardBatch | None = None, last_sampled: torch.Tensor | None = None,
                capture: tuple[int, ...] = (), all_rows: bool = False) -> ForwardOutput:
        """One forward over the plan -> float32 logits for its logits rows (and the hidden states of the layers
        in ``capture``, HF numbering: 0 = embeddings, i = after layer i, L = after the final norm; for the logits
        rows, or with ``all_rows`` for every token of the plan in order: what an EAGLE head reads).
        ``last_sampled``: the previous step's sampled tokens, for the plan's placeholders."""
        batch = batch if batch is not None else self.prepare(plan)
        if batch.kv_moves is not None:
            self.kv_cache.copy_slots(*batch.kv_moves)
            self._bound_moved_keys(batch)
        if batch.kv_seals is not None:
            self.kv_cache.seal_from_window(*batch.kv_seals)
        if batch.placeholders is not None:    # rank 0 holds the sampled tokens; the other ranks receive them
            idx, rows = batch.placeholders
            tokens = last_sampled[rows].to(idx.dtype) if self.tp.is_first else torch.empty_like(idx)
            batch.input_ids[idx] = self.tp.broadcast(tokens)
        graph = self.graphs.bucket(plan, batch) if self.graphs is not None and not (capture or all_rows) else None
        self.last_graph = (graph.batch, graph.query_len) if graph is not None else None
        if graph is not None:
            out = ForwardOutput(self.graphs.replay(graph, batch))
        else:
            self.backend.plan(batch.meta)
            captured: dict[int, torch.Tensor] = {}
            hidden = self.model(batch.input_ids, batch.meta, capture=capture, captured=captured)
            rows = batch.logits_indices
            keep = slice(0, plan.num_tokens) if all_rows else rows
            out = ForwardOutput(self.model.compute_logits(hidden[rows]), {i: h[keep] for i, h in captured.items()})
        if batch.kv_seals_after is not None:     # the blocks this step filled, read at full precision by it
            self.kv_cache.seal_from_window(*batch.kv_seals_after)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of given hidden states (DoLa's early exits), through the model's LM head."""
        return self.model.compute_logits(hidden)

    def read_kv_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Pool blocks as CPU tensors (a KV export, engine/kv_transfer.py)."""
        return self.kv_cache.read_blocks(blocks)

    def _bound_moved_keys(self, batch: ForwardBatch) -> None:
        """Sparse pages: keys that a KV move put into another block (an accepted tree branch compacted into place,
        a beam fork's copy of its parent's partial block) are folded into their new blocks' bounds. A windowed
        cache moves window slots: their pool blocks are found through this step's window table and seals (moves of
        a sequence the step does not run are left out)."""
        sparse = self._pages
        if sparse is None:
            return
        _, dst = batch.kv_moves
        bs, meta = self.block_size, batch.meta
        pool = dst
        if self.kv_layout.windowed:
            owner = torch.full((self.num_window_blocks,), -1, dtype=torch.long, device=dst.device)
            open_ = meta.kv_window >= 0
            owner[meta.kv_window[open_]] = meta.block_tables[open_]
            if meta.kv_seal is not None:              # blocks this step seals have left kv_window already
                held = meta.kv_seal.window >= 0
                owner[meta.kv_seal.window[held]] = meta.kv_seal.blocks[held]
            pool = owner[dst // bs] * bs + dst % bs
            keep = owner[dst // bs] >= 0
            dst, pool = dst[keep], pool[keep]
        if not len(dst):
            return
        for i in sorted(sparse.selection_layers):
            sparse.record_keys(i, self.kv_cache.keys_at(i, dst), pool, self.model.layers[i].self_attn.kv_cache, bs)

    def seal_kv_blocks(self, seals: tuple[tuple[int, int], ...]) -> None:
        """Late seals outside a step (before a KV export reads the blocks)."""
        if seals:
            idx = torch.tensor(seals, dtype=torch.long, device=self.device)
            self.kv_cache.seal_from_window(idx[:, 0], idx[:, 1])

    def write_kv_blocks(self, blocks: list[int], data: list[tuple[torch.Tensor, ...]]) -> None:
        """Blocks of another runner of the same layout into the pool (a KV import)."""
        self.kv_cache.write_blocks(blocks, data)
        sparse = self._pages
        if sparse is not None and blocks:                            # their keys' bounds, for page selection
            idx = torch.tensor(blocks, device=self.device)
            for i in sorted(sparse.selection_layers):                # (the dense layers keep none)
                sparse.record_blocks(i, self.model.layers[i].self_attn.kv_cache, idx, self.block_size)

    def close(self) -> None:
        """Release the weights, the KV pool and the CUDA graphs now (the executor protocol's shutdown hook). The
        engine's start-up objects are frozen out of the garbage collector's reach (engine.py), so without this a
        closed engine's GPU memory would stay taken until the process ends."""
        for layer in getattr(self.model, "layers", ()):
            layer.self_attn.kv_cache = None
        if self.model is not None:
            cpu_layer.drop_stack(self.model)
        self.graphs = self.model = self.kv_cache = self.buffers = None


def _sparse_attention(cfg: EngineConfig, model_cfg: ModelConfig) -> SparseAttention | None:
    """The model's lossy sparse decoding settings (attention/sparse.py), or None when off."""
    if cfg.sparse_attention is None:
        return None
    if model_cfg.sliding_window is not None:
        raise ValueError("sparse_attention does not support sliding-window attention models")
    from leapdecode.attention.sparse import SparseAttention
    return SparseAttention(cfg.sparse_attention, model_cfg.num_layers)


def _scratch_blocks(cfg: EngineConfig) -> int:
    spec = cfg.speculative_config
    if spec is None or not {"layer_skip", "kangaroo"} & set(spec.model_methods):
        return 0
    from leapdecode.spec.layer_skip import scratch_blocks_needed
    return scratch_blocks_needed(cfg.block_size, spec.num_speculative_tokens, cfg.max_num_seqs)
