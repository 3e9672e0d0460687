"""Owns the model and the KV pool; turns a scheduled batch into one forward pass and returns logits rows.

Logits are computed only where a next token is needed: the last row of a prefill that reaches the end of the
known tokens, every verified position of a draft, and (when asked) every prompt position for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from leapdecode.attention.backend import AttentionMetadata, get_backend
from leapdecode.config import EngineConfig
from leapdecode.engine.scheduler import SchedulerOutput
from leapdecode.model.config import ModelConfig
from leapdecode.model.loader import load_model


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # for each scheduled sequence, the range of its rows in the logits tensor
    row_ranges: list[tuple[int, int]]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, max_model_len: int) -> None:
        self.cfg, self.model_cfg, self.dtype = cfg, model_cfg, dtype
        self.device = cfg.torch_device
        self.block_size = cfg.block_size
        self.backend = get_backend("auto", self.device)
        self.model = load_model(cfg.model, model_cfg, self.backend, dtype, self.device, max_model_len)
        self.num_blocks = self._num_blocks(max_model_len)
        c = model_cfg
        self.kv_cache = torch.zeros(c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                                    dtype=dtype, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache[i]

    @property
    def kv_bytes_per_block(self) -> int:
        c = self.model_cfg
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def _num_blocks(self, max_model_len: int) -> int:
        if self.cfg.num_kv_blocks is not None:
            blocks = self.cfg.num_kv_blocks
        else:
            budget = self.cfg.kv_cache_memory
            if budget is None:
                budget = self._default_kv_budget(max_model_len)
            blocks = budget // self.kv_bytes_per_block
        need = -(-max_model_len // self.block_size)
        if blocks < need:
            raise ValueError(
                f"the KV cache ({blocks} blocks of {self.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens ({need} blocks): raise kv_cache_memory or lower max_model_len")
        return blocks

    def _default_kv_budget(self, max_model_len: int) -> int:
        """CUDA: 90% of what is free after the weights; CPU: room for max_num_seqs full sequences, at most 4 GiB."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        want = self.cfg.max_num_seqs * max_model_len // self.block_size * self.kv_bytes_per_block
        return max(min(want, 4 << 30), -(-max_model_len // self.block_size) * self.kv_bytes_per_block)

    # -- one step ----------------------------------------------------------------------------------------------
    def prepare(self, batch: SchedulerOutput, prompt_logprob_seqs: set[int]) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_idx, row_ranges = [], [], [], []
        tree_masks: dict[int, torch.Tensor] = {}
        for i, s in enumerate(batch.scheduled):
            seq, n, start = s.seq, s.num_new_tokens, s.start
            base = len(input_ids)
            input_ids += seq.tokens_with_spec(start, start + n)
            pos = list(range(start, start + n))
            if seq.draft_parents is not None and s.samples:
                pos, tree_masks[i] = _tree_positions_and_mask(seq, start, n, self.device)
            positions += pos
            slots += self.slots(seq.block_table, range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            first_row = len(logits_idx)
            if seq.seq_id in prompt_logprob_seqs:
                logits_idx += range(base, base + n)
            elif s.samples:
                logits_idx += range(base + n - 1 - len(seq.draft_tokens), base + n)
            row_ranges.append((first_row, len(logits_idx)))
        dev = self.device
        width = max(len(s.seq.block_table) for s in batch.scheduled)
        tables = torch.zeros(len(batch.scheduled), width, dtype=torch.int32)
        for i, s in enumerate(batch.scheduled):
            tables[i, :len(s.seq.block_table)] = torch.tensor(s.seq.block_table, dtype=torch.int32)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_lens=query_lens, seq_lens_host=seq_lens, block_size=bs,
            sliding_window=self.model_cfg.sliding_window, tree_masks=tree_masks)
        return StepInputs(torch.tensor(input_ids, dtype=torch.long, device=dev), meta,
                          torch.tensor(logits_idx, dtype=torch.long, device=dev), row_ranges)

    def slots(self, block_table: list[int], positions: list[int]) -> list[int]:
        bs = self.block_size
        return [block_table[j // bs] * bs + j % bs for j in positions]

    @torch.inference_mode()
    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the KV of token indices ``src`` to ``dst`` in every layer (compacting an accepted tree branch)."""
        L, _, nb, bs, h, d = self.kv_cache.shape
        flat = self.kv_cache.view(L, 2, nb * bs, h, d)
        s = torch.tensor(self.slots(block_table, src), device=self.device)
        t = torch.tensor(self.slots(block_table, dst), device=self.device)
        flat[:, :, t] = flat[:, :, s].clone()

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """One forward over the flat batch -> float32 logits for the requested rows."""
        hidden = self.model(inputs.input_ids, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])


def _tree_positions_and_mask(seq, start: int, n: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Positions and visibility for a chunk that ends in a token tree: committed tokens are causal; a draft node
    sits at (last committed position + depth) and sees the committed tokens, its ancestors and itself."""
    parents = seq.draft_parents
    committed = n - len(parents)                       # committed tokens in this chunk (>= 1)
    last_pos = seq.num_tokens - 1
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    positions = list(range(start, start + committed)) + [last_pos + d for d in depth]
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    mask[committed:, committed:] = False
    for i, p in enumerate(parents):
        row = committed + i
        mask[row, committed + i] = True
        if p >= 0:
            mask[row, committed:] |= mask[committed + p, committed:]
    return positions, mask.to(device)
