"""The paged KV pool of one model, as an object: its layout, its dtype, and the copies that move KV around.

Layout: ``[layers, 2 (keys, values), blocks, block_size, kv_heads, head_dim]``; layer i's view is handed to the
model's attention layer i. A slot is ``block * block_size + offset``. ``scales`` is where a quantized cache keeps
its per-block scales (none yet); whoever copies KV goes through ``copy_slots`` so scales can never be forgotten.

On CPU the pool is taken from the allocator as zero pages that the kernel maps on first write (``calloc``), so
a large pool costs nothing at start-up and only the blocks actually used ever become resident.
"""
from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.data = _zeros(shape, dtype, device)
        self.scales: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's cache: [2, blocks, block_size, kv_heads, head_dim]."""
        return self.data[i]

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV at slots ``src`` to slots ``dst`` in every layer (all reads happen before any write)."""
        L, _, nb, bs, h, d = self.data.shape
        flat = self.data.view(L, 2, nb * bs, h, d)
        flat[:, :, dst] = flat[:, :, src].clone()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))     # calloc: untouched pages stay unmapped
    return raw.view(dtype).view(shape)
