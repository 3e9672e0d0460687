"""CUDA graphs for decode and verification steps: the whole forward (attention plan, every layer, LM head) captured
once per bucket and replayed, so a step costs a handful of launches instead of a few hundred.

A bucket is (B sequences, q tokens at most per sequence): q = 1 for plain decoding (the split-KV decode kernel),
q = k + 1 for verifying k speculative tokens (the prefill kernel, which also takes sequences with fewer tokens).
A step is replayed in the smallest bucket that holds it; steps no bucket holds (prefill chunks, token trees,
prompt logprobs, hidden-state capture) run eagerly, which is also the reference the graphs are tested against.

Every graph reads the same static input buffers (``_Static``), sized for the largest bucket; a replay first copies
the step's inputs into them. Rows past the step's tokens and sequences past its sequences are padding: their slot
is -1 (they write no KV), a padding sequence of a decode bucket attends over one key and one of a verification
bucket has no tokens, and their outputs are never read. The decode kernel's split count is fixed at capture for
the longest sequence the engine serves (``max_model_len``); shorter sequences leave trailing slices empty.

A windowed KV cache (int8/int4, fp8 keeping recent tokens) adds the step's window table, each token's window slot
and the blocks it seals to the static inputs. Sealing (quantizing a block as it leaves the window, in every layer)
has data-dependent sizes, so each bucket has two graphs: one for steps that seal nothing, and one whose seal plan is
padded to the bucket's batch plus one dummy seal: padding seals quantize an empty tile into ``trash_block``, a pool
block past the block manager's that nothing reads, and padding stage rows land in the dummy seal's tile. A step
that seals more blocks than its bucket has sequences runs eagerly.

All buckets are captured when the runner starts (largest first, sharing one memory pool), never while serving:
capturing while another thread launches work on the GPU would break the capture.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from leapdecode.attention.backend import AttentionMetadata, SealPlan
from leapdecode.engine.input_batch import ForwardBatch
from leapdecode.engine.step import StepPlan

log = logging.getLogger(__name__)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_batches(max_batch: int) -> tuple[int, ...]:
    """The batch sizes to capture: the table up to ``max_batch``, and ``max_batch`` itself."""
    return tuple(sorted({b for b in GRAPH_BATCHES if b < max_batch} | {max_batch})) if max_batch > 0 else ()


def step_shape(plan: StepPlan) -> tuple[int, int] | None:
    """(sequences, most tokens of one sequence) of a plan a graph can run, or None: every sequence samples from
    its chunk's last rows only (no prompt logprobs) and carries no token tree."""
    q = 0
    for s in plan.seqs:
        if s.prompt_logprobs or not s.samples or (s.draft and s.draft.parents is not None):
            return None
        q = max(q, s.num_new_tokens)
    return len(plan.seqs), q


class _Static:
    """The graphs' input buffers, sized for the largest bucket; a bucket uses their leading views."""

    def __init__(self, max_batch: int, max_q: int, max_blocks: int, device: torch.device, windowed: bool,
                 block_size: int) -> None:
        t = max_batch * max_q
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.positions, self.logits_indices = z(t), z(t), z(t)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = z(max_batch, max_blocks)
        self.seq_lens = z(max_batch)
        self.query_start_loc = z(max_batch + 1)
        self.identity = torch.arange(t + 1, dtype=torch.int64, device=device)   # decode buckets: rows = starts
        if windowed:        # a windowed cache's fields (see AttentionMetadata and SealPlan); S = batch + 1 seals
            self.kv_write = torch.full((t,), -1, dtype=torch.int64, device=device)
            self.kv_window = torch.full((max_batch, max_blocks), -1, dtype=torch.int64, device=device)
            self.seal_blocks, self.seal_window = z(max_batch + 1), z(max_batch + 1)
            self.stage_index, self.stage_rows = z(t), z(t)
            self.probes = torch.full((max_batch + 1, block_size), -1, dtype=torch.int64, device=device)


@dataclass
class _Graph:
    batch: int
    query_len: int
    graph: torch.cuda.CUDAGraph | None     # None: the static forward runs eagerly (CPU tests of the buffers)
    logits: torch.Tensor | None   # [batch * query_len, vocab] float32, written by every replay
    sealing: bool = False         # a windowed cache's twin that seals blocks (see the module docstring)


class CudaGraphs:
    """Captures and replays the forward of the runner's model for decode (q = 1) and verification buckets."""

    def __init__(self, model, backend, device: torch.device, block_size: int, max_model_len: int,
                 sliding_window: int | None, max_batch: int, query_lens: tuple[int, ...] = (1,),
                 capture_graphs: bool = True, trash_block: int | None = None) -> None:
        """``capture_graphs=False`` keeps every bucket's static buffers and padding but runs them eagerly: how the
        CPU tests check the buffers, the padding and the graph plan without a GPU. ``trash_block``: a windowed KV
        cache's pool block that padding seals write (None: the cache is not windowed)."""
        self.capture_graphs = capture_graphs
        self.model, self.backend, self.device = model, backend, device
        self.block_size, self.max_model_len, self.sliding_window = block_size, max_model_len, sliding_window
        self.max_blocks = -(-max_model_len // block_size)
        self.batches = graph_batches(max_batch)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.trash_block = trash_block
        self.static = _Static(max(self.batches), max(self.query_lens), self.max_blocks, device,
                              trash_block is not None, block_size)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.sealing: dict[tuple[int, int], _Graph] = {}     # windowed caches: the twins that seal
        self.pool = None
        self.num_replays = 0
        self.num_sealing_replays = 0
        self.used: set[tuple[int, int]] = set()     # buckets replayed at least once (tests, stats)
        self.capture_seconds = 0.0

    # -- capture -------------------------------------------------------------------------------------------------
    def _meta(self, batch: int, q: int, sealing: bool = False) -> tuple[torch.Tensor, AttentionMetadata,
                                                                         torch.Tensor]:
        st, t = self.static, batch * q
        starts, rows = (st.identity, st.identity) if q == 1 else (st.query_start_loc, st.logits_indices)
        meta = AttentionMetadata(
            positions=st.positions[:t], slot_mapping=st.slot_mapping[:t], block_tables=st.block_tables[:batch],
            seq_lens=st.seq_lens[:batch], query_start_loc=starts[:batch + 1],
            query_lens=[q] * batch, seq_lens_host=[self.max_model_len] * batch, block_size=self.block_size,
            num_actual_tokens=t, sliding_window=self.sliding_window)
        if self.trash_block is not None:
            meta.kv_write, meta.kv_window = st.kv_write[:t], st.kv_window[:batch]
            if sealing:
                meta.kv_seal = SealPlan(st.seal_blocks[:batch + 1], st.seal_window[:batch + 1], st.stage_index[:t],
                                        st.stage_rows[:t], st.probes[:batch + 1])
        return st.input_ids[:t], meta, rows[:t]

    def _forward(self, batch: int, q: int, sealing: bool = False) -> torch.Tensor:
        ids, meta, rows = self._meta(batch, q, sealing)
        self.backend.plan_graph(meta, q)
        return self.model.compute_logits(self.model(ids, meta)[rows])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (later, smaller graphs reuse the pool's memory)."""
        t0 = time.perf_counter()
        st = self.static
        for sealing in ((False, True) if self.trash_block is not None else (False,)):
            into = self.sealing if sealing else self.graphs
            for q in sorted(self.query_lens, reverse=True):
                for b in sorted(self.batches, reverse=True):
                    if not self.capture_graphs:
                        into[(b, q)] = _Graph(b, q, None, None, sealing)
                        continue
                    self._idle_inputs(q)                     # warm-up and capture write no KV, seal no real block
                    self._forward(b, q, sealing)             # compiles the kernels outside the capture
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        logits = self._forward(b, q, sealing)
                    if self.pool is None:
                        self.pool = graph.pool()
                    into[(b, q)] = _Graph(b, q, graph, logits, sealing)
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (batches %s, query lengths %s) in %.1f s",
                 len(self.graphs) + len(self.sealing), self.batches, self.query_lens, self.capture_seconds)

    def _idle_inputs(self, q: int) -> None:
        """Static inputs that write no KV and seal only into the trash block (capture, replay-time pricing)."""
        st = self.static
        st.slot_mapping.fill_(-1)
        st.seq_lens.fill_(q)
        st.query_start_loc.copy_(torch.arange(st.query_start_loc.numel(), device=self.device) * q)
        st.logits_indices.copy_(torch.arange(st.logits_indices.numel(), device=self.device))
        if self.trash_block is not None:
            st.kv_write.fill_(-1)
            st.kv_window.fill_(-1)
            st.seal_blocks.fill_(self.trash_block)
            st.seal_window.fill_(-1)
            st.stage_index.zero_()
            st.stage_rows.zero_()
            st.probes.fill_(-1)

    # -- replay --------------------------------------------------------------------------------------------------
    def bucket(self, plan: StepPlan, batch: ForwardBatch) -> _Graph | None:
        """The graph of the smallest bucket holding the step, or None (run it eagerly)."""
        shape = step_shape(plan)
        if shape is None or batch.meta.block_tables.shape[1] > self.max_blocks:
            return None
        bucket = self.shape_bucket(*shape)
        if bucket is None:
            return None
        seal = batch.meta.kv_seal
        if seal is None:
            return self.graphs.get(bucket)
        return self.sealing.get(bucket) if seal.blocks.shape[0] <= bucket[0] else None

    def shape_bucket(self, num_seqs: int, max_q: int) -> tuple[int, int] | None:
        """The (batch, query length) bucket that would run a step of ``num_seqs`` sequences of at most ``max_q``
        tokens each, or None (eager). The speculation controller prices draft sizes with it."""
        b = self.batch_bucket(num_seqs)
        q = next((x for x in self.query_lens if x >= max_q), None)
        return None if b is None or q is None or (b, q) not in self.graphs else (b, q)

    @torch.inference_mode()
    def replay_seconds(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Seconds per replay of every captured graph on its capture-time inputs (no KV written): the GPU's
        share of each bucket's step, the speculation controller's prior. Empty when graphs run eagerly."""
        out: dict[tuple[int, int], float] = {}
        self.static.slot_mapping.fill_(-1)
        if self.trash_block is not None:
            self.static.kv_write.fill_(-1)
        for bucket, g in self.graphs.items():
            if g.graph is None:
                continue
            g.graph.replay()
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                g.graph.replay()
            torch.cuda.synchronize(self.device)
            out[bucket] = (time.perf_counter() - t0) / repeats
        return out

    def batch_bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size holding ``num_seqs`` sequences (None: more than the largest)."""
        return next((b for b in self.batches if b >= num_seqs), None)

    def replay(self, g: _Graph, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits rows, from the graph of its bucket (inputs copied into the static buffers first)."""
        st, meta = self.static, batch.meta
        n, t, rows = meta.num_seqs, batch.num_tokens, batch.logits_indices.shape[0]
        size = g.batch * g.query_len
        st.input_ids[:t].copy_(batch.input_ids[:t])
        st.positions[:t].copy_(meta.positions[:t])
        st.slot_mapping[:t].copy_(meta.slot_mapping[:t])
        st.slot_mapping[t:size].fill_(-1)
        width = meta.block_tables.shape[1]
        st.block_tables[:n, :width].copy_(meta.block_tables)
        st.seq_lens[:n].copy_(meta.seq_lens)
        if g.query_len == 1:                               # one token each: rows and starts are the identity
            st.seq_lens[n:g.batch].fill_(1)
        else:
            st.query_start_loc[:n + 1].copy_(meta.query_start_loc)
            st.query_start_loc[n + 1:g.batch + 1].fill_(t)    # padding sequences have no tokens
            st.logits_indices[:rows].copy_(batch.logits_indices)
            st.logits_indices[rows:size].fill_(0)
        if self.trash_block is not None:
            self._copy_window_fields(g, meta, t, size)
        self.num_replays += 1
        self.num_sealing_replays += g.sealing
        self.used.add((g.batch, g.query_len))
        if g.graph is None:
            return self._forward(g.batch, g.query_len, g.sealing)[:rows]
        g.graph.replay()
        return g.logits[:rows]          # (overwritten by the next replay: read before the next step)

    def _copy_window_fields(self, g: _Graph, meta: AttentionMetadata, t: int, size: int) -> None:
        """A windowed cache's step fields into the static buffers: window slots (padding tokens -1), the window
        table (padding sequences: all pool, none read), and for a sealing graph the seal plan padded to batch + 1
        seals: padding seals quantize an empty tile into the trash block, padding stage rows go to the last
        (always padding) seal's tile."""
        st, n = self.static, meta.num_seqs
        st.kv_write[:t].copy_(meta.kv_write[:t])
        st.kv_write[t:size].fill_(-1)
        st.kv_window[:n, :meta.kv_window.shape[1]].copy_(meta.kv_window)
        st.kv_window[n:g.batch].fill_(-1)
        if not g.sealing:
            return
        seal, S = meta.kv_seal, g.batch + 1
        ns, r = seal.blocks.shape[0], seal.stage_index.shape[0]
        st.seal_blocks[:ns].copy_(seal.blocks)
        st.seal_blocks[ns:S].fill_(self.trash_block)
        st.seal_window[:ns].copy_(seal.window)
        st.seal_window[ns:S].fill_(-1)
        st.stage_index[:r].copy_(seal.stage_index)
        st.stage_index[r:size].fill_((S - 1) * self.block_size)
        st.stage_rows[:r].copy_(seal.stage_rows)
        st.stage_rows[r:size].zero_()
        st.probes[:ns].copy_(seal.probes)
        st.probes[ns:S].fill_(-1)
