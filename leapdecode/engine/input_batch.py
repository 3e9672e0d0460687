"""A step plan as the model's inputs: plain tensors written into persistent buffers with one host-to-device copy.

Every integer the forward pass needs (token ids, positions, slots, block tables, query/key lengths, logits rows,
KV moves, placeholder rows, tree masks) is written, packed one field after another, into a host staging buffer
(pinned on CUDA) and copied to its device twin in one ``copy_``; the fields are then views of the device buffer.
Two staging pairs alternate, so the next step can be prepared while the previous one still reads its inputs. The
buffers only grow (doubling), so after warm-up a step allocates nothing.

With ``pad=True`` (for CUDA-graph replay) the token count is rounded up to a capacity bucket and the block table
to its full width; padding tokens have slot -1 and belong to no sequence.

For a windowed KV cache (int8/int4, fp8 with recent tokens) the plan's window blocks and seals become the
metadata's ``kv_write`` (window slot per token), ``kv_window`` (window block per table entry) and ``kv_seal`` (see
attention/backend.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leapdecode.attention.backend import AttentionMetadata, SealPlan
from leapdecode.engine.step import ScheduledSeq, StepPlan

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int) -> int:
    """The smallest capacity bucket holding ``n`` tokens (multiples of 256 past the table)."""
    for b in TOKEN_BUCKETS:
        if n <= b:
            return b
    return -(-n // 256) * 256


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] (T >= num_tokens when padded)
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # [R] rows of the hidden states that need logits
    kv_moves: tuple[torch.Tensor, torch.Tensor] | None     # (src slots, dst slots), applied before the forward
    kv_seals: tuple[torch.Tensor, torch.Tensor] | None     # (pool blocks, window blocks): late seals, after the moves
    kv_seals_after: tuple[torch.Tensor, torch.Tensor] | None  # (pool blocks, window blocks): after the forward
    placeholders: tuple[torch.Tensor, torch.Tensor] | None  # (token indices, rows of the last step's samples)
    num_tokens: int


class InputBuffers:
    def __init__(self, device: torch.device, capacity: int = 1 << 14, windowed: bool = False) -> None:
        self.device, self.windowed = device, windowed
        self._slots = [self._alloc(capacity), self._alloc(capacity)]
        self._turn = 0
        self.num_builds = 0          # steps prepared: on a GPU, one host-to-device copy each
        self.num_copies = 0          # host-to-device copies actually made (none on CPU: the buffer is the input)

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pin = self.device.type == "cuda"
        host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        dev = host if self.device.type == "cpu" else torch.zeros(n, dtype=torch.int64, device=self.device)
        return host, dev

    def build(self, plan: StepPlan, sliding_window: int | None, pad: bool = False,
              max_blocks: int | None = None) -> ForwardBatch:
        bs = plan.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, qlens, logits_idx = [0], [], [], []
        tree_offsets: list[int] | None = None
        tree_flat: list[int] = []
        width = max(len(s.block_table) for s in plan.seqs)
        if pad and max_blocks is not None:
            width = max(width, max_blocks)
        tables = np.zeros((len(plan.seqs), width), dtype=np.int64)
        window = _WindowFields(len(plan.seqs), width, bs) if self.windowed else None
        for i, s in enumerate(plan.seqs):
            n, base = s.num_new_tokens, len(ids)
            ids += s.token_ids
            pos += s.positions() if s.draft else range(s.start, s.start + n)
            table = s.block_table
            tables[i, :len(table)] = table
            if n <= 16:
                slots += [table[j // bs] * bs + j % bs for j in range(s.start, s.start + n)]
            else:
                j = np.arange(s.start, s.start + n)
                slots += (tables[i, j // bs] * bs + j % bs).tolist()
            if window is not None:
                window.add(i, s, base)
            qlens.append(n)
            qsl.append(qsl[-1] + n)
            seq_lens.append(s.start + n)
            if s.prompt_logprobs:
                logits_idx += range(base, base + n)
            elif s.samples:
                logits_idx += range(base + n - s.num_samples, base + n)
            if s.draft and s.draft.parents is not None:
                if tree_offsets is None:
                    tree_offsets = [-1] * len(plan.seqs)
                tree_offsets[i] = len(tree_flat)
                tree_flat += _chunk_tree_mask(s.num_committed, s.draft.ancestor_mask())
        T = len(ids)
        Tp = bucket(T) if pad else T
        if Tp > T:
            ids += [0] * (Tp - T)
            pos += [0] * (Tp - T)
            slots += [-1] * (Tp - T)
        moves = plan.kv_moves
        ph = plan.placeholders
        fields = [ids, pos, slots, qsl, seq_lens, tables.reshape(-1), logits_idx,
                  [m[0] for m in moves], [m[1] for m in moves], [p[0] for p in ph], [p[1] for p in ph],
                  tree_offsets or [], tree_flat, [b for b, _ in plan.kv_seals], [w for _, w in plan.kv_seals],
                  [b for b, _ in plan.kv_seals_after], [w for _, w in plan.kv_seals_after]]
        fields += window.fields(Tp) if window is not None else [[]] * len(_WindowFields.NAMES)
        sizes = [len(f) for f in fields]
        host, dev = self._staging(sum(sizes))
        self.num_builds += 1
        hnp = host.numpy()
        o = 0
        for f, n in zip(fields, sizes):
            if n:
                hnp[o:o + n] = f
            o += n
        if dev is not host:
            dev[:o].copy_(host[:o], non_blocking=True)
            self.num_copies += 1
        v = dev[:o].split(sizes)
        (ids_t, pos_t, slots_t, qsl_t, seq_lens_t, tables_t, logits_t, src_t, dst_t, ph_idx_t, ph_row_t,
         tree_off_t, tree_t, seal_blocks_t, seal_window_t, after_blocks_t, after_window_t) = v[:17]
        kv = dict(zip(_WindowFields.NAMES, v[17:]))
        meta = AttentionMetadata(
            positions=pos_t, slot_mapping=slots_t, block_tables=tables_t.view(len(plan.seqs), width),
            seq_lens=seq_lens_t, query_start_loc=qsl_t, query_lens=qlens, seq_lens_host=seq_lens, block_size=bs,
            num_actual_tokens=T, sliding_window=sliding_window,
            tree_mask=tree_t != 0 if tree_offsets else None, tree_offsets=tree_off_t if tree_offsets else None,
            tree_offsets_host=tree_offsets)
        if window is not None:
            meta.kv_write = kv["write"]
            meta.kv_window = kv["window"].view(len(plan.seqs), width)
            if window.num_seals:
                meta.kv_seal = SealPlan(kv["seal_blocks"], kv["seal_window"], kv["stage_index"], kv["stage_rows"],
                                        kv["probes"].view(window.num_seals, bs))
        return ForwardBatch(ids_t, meta, logits_t, (src_t, dst_t) if moves else None,
                            (seal_blocks_t, seal_window_t) if plan.kv_seals else None,
                            (after_blocks_t, after_window_t) if plan.kv_seals_after else None,
                            (ph_idx_t, ph_row_t) if ph else None, T)

    def _staging(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._turn ^= 1
        host, dev = self._slots[self._turn]
        if host.numel() < n:
            self._slots[self._turn] = self._alloc(max(n, 2 * host.numel()))
            host, dev = self._slots[self._turn]
        return host, dev


class _WindowFields:
    """The windowed-cache fields of one step, gathered sequence by sequence (numpy, one pass)."""
    NAMES = ("write", "window", "seal_blocks", "seal_window", "stage_index", "stage_rows", "probes")

    def __init__(self, num_seqs: int, width: int, block_size: int) -> None:
        self.bs = block_size
        self.window = np.full((num_seqs, width), -1, dtype=np.int64)
        self.write: list[np.ndarray] = []
        self.seal_blocks: list[int] = []
        self.seal_window: list[int] = []
        self.stage_index: list[np.ndarray] = []
        self.stage_rows: list[np.ndarray] = []
        self.probes: list[np.ndarray] = []

    @property
    def num_seals(self) -> int:
        return len(self.seal_blocks)

    def add(self, i: int, s: ScheduledSeq, base: int) -> None:
        """Sequence i's tokens (flat rows from ``base``): a token of an open block goes to its window slot, a token
        of a block sealed this step to the stage, a token of a block sealed before nowhere (it is recomputed with
        the values it already has)."""
        bs, table = self.bs, s.block_table
        first_open = len(table) - len(s.kv_window)
        first_seal = first_open - len(s.kv_sealing)
        self.window[i, first_open:len(table)] = s.kv_window
        j = np.arange(s.start, s.start + s.num_new_tokens)
        blk, off = j // bs, j % bs
        is_open = blk >= first_open
        write = np.full(len(j), -1, dtype=np.int64)
        if s.kv_window:
            write[is_open] = np.asarray(s.kv_window, dtype=np.int64)[blk[is_open] - first_open] * bs + off[is_open]
        self.write.append(write)
        if not s.kv_sealing:
            return
        seal0 = len(self.seal_blocks)
        self.seal_blocks += table[first_seal:first_open]
        self.seal_window += s.kv_sealing
        staged = (blk >= first_seal) & ~is_open
        rows = base + np.flatnonzero(staged)
        index = (seal0 + blk[staged] - first_seal) * bs + off[staged]
        self.stage_index.append(index)
        self.stage_rows.append(rows)
        probes = np.full((len(s.kv_sealing), bs), -1, dtype=np.int64)
        probes.reshape(-1)[index - seal0 * bs] = rows
        lone = probes.max(axis=1) < 0                  # sealed with none of its tokens in this step (accepted drafts)
        probes[lone, bs - 1] = base                    # probe: the sequence's first query, which sees the whole block
        self.probes.append(probes.reshape(-1))

    def fields(self, num_tokens: int) -> list:
        write = np.concatenate(self.write) if self.write else np.zeros(0, dtype=np.int64)
        write = np.concatenate([write, np.full(num_tokens - len(write), -1, dtype=np.int64)])
        cat = (lambda xs: np.concatenate(xs) if xs else [])
        return [write, self.window.reshape(-1), self.seal_blocks, self.seal_window, cat(self.stage_index),
                cat(self.stage_rows), cat(self.probes)]


def _chunk_tree_mask(num_committed: int, ancestors: list[list[bool]]) -> list[int]:
    """The [q, q] visibility of a chunk that ends in a tree, flat: committed tokens causal, every draft node sees
    the committed tokens, its ancestors and itself."""
    c, d = num_committed, len(ancestors)
    q = c + d
    rows = [[1] * (i + 1) + [0] * (q - i - 1) for i in range(c)]
    rows += [[1] * c + [int(x) for x in anc] for anc in ancestors]
    return [x for row in rows for x in row]
