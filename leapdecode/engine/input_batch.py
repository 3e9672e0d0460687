"""A step plan as the model's inputs: plain tensors written into persistent buffers with one host-to-device copy.

Every integer the forward pass needs (token ids, positions, slots, block tables, query/key lengths, logits rows,
KV moves, placeholder rows, tree masks) is written, packed one field after another, into a host staging buffer
(pinned on CUDA) and copied to its device twin in one ``copy_``; the fields are then views of the device buffer.
Two staging pairs alternate, so the next step can be prepared while the previous one still reads its inputs. The
buffers only grow (doubling), so after warm-up a step allocates nothing.

With ``pad=True`` (for CUDA-graph replay) the token count is rounded up to a capacity bucket and the block table
to its full width; padding tokens have slot -1 and belong to no sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leapdecode.attention.backend import AttentionMetadata
from leapdecode.engine.step import StepPlan

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
    placeholders: tuple[torch.Tensor, torch.Tensor] | None  # (token indices, rows of the last step's samples)
    num_tokens: int


class InputBuffers:
    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
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
                  tree_offsets or [], tree_flat]
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
         tree_off_t, tree_t) = v
        meta = AttentionMetadata(
            positions=pos_t, slot_mapping=slots_t, block_tables=tables_t.view(len(plan.seqs), width),
            seq_lens=seq_lens_t, query_start_loc=qsl_t, query_lens=qlens, seq_lens_host=seq_lens, block_size=bs,
            num_actual_tokens=T, sliding_window=sliding_window,
            tree_mask=tree_t != 0 if tree_offsets else None, tree_offsets=tree_off_t if tree_offsets else None,
            tree_offsets_host=tree_offsets)
        return ForwardBatch(ids_t, meta, logits_t, (src_t, dst_t) if moves else None,
                            (ph_idx_t, ph_row_t) if ph else None, T)

    def _staging(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._turn ^= 1
        host, dev = self._slots[self._turn]
        if host.numel() < n:
            self._slots[self._turn] = self._alloc(max(n, 2 * host.numel()))
            host, dev = self._slots[self._turn]
        return host, dev


def _chunk_tree_mask(num_committed: int, ancestors: list[list[bool]]) -> list[int]:
    """The [q, q] visibility of a chunk that ends in a tree, flat: committed tokens causal, every draft node sees
    the committed tokens, its ancestors and itself."""
    c, d = num_committed, len(ancestors)
    q = c + d
    rows = [[1] * (i + 1) + [0] * (q - i - 1) for i in range(c)]
    rows += [[1] * c + [int(x) for x in anc] for anc in ancestors]
    return [x for row in rows for x in row]
