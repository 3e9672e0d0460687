"""Who this process is in a tensor-parallel group, and the collectives the sharded model needs.

A tensor-parallel group is N processes that each hold 1/N of every large weight (``model/parallel_layers.py``). A
forward pass meets in three kinds of collective: an all-reduce after each row-parallel linear and after the
vocab-parallel embedding, a gather of the logits' vocabulary slices to rank 0, and a broadcast from rank 0 of
values only it holds (the previous step's sampled tokens, DoLa's hidden states). A ``ParallelState`` is handed to
every layer that needs one, explicitly, as attention metadata is (no global context: a process may hold a sharded
model and unsharded ones side by side); ``SINGLE`` turns every collective into the identity, so one model file
serves TP=1 with unchanged numerics.

The group is torch.distributed's default process group (gloo on CPU, nccl on CUDA), so a process belongs to at most
one tensor-parallel group at a time; the executor that creates it destroys it when it closes.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (every rank gets the sum)."""
        if self.size > 1 and x.numel():
            dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (the others pass a buffer of the same shape and dtype), in place."""
        if self.size > 1 and x.numel():
            dist.broadcast(x, src=0)
        return x

    def gather_last_dim(self, x: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank 0: the ranks' slices of the last dimension side by side (rank r's slice is ``split(total)[r]``
        wide); the other ranks: None. Slices are padded to equal width for the collective and cut after."""
        if self.size == 1:
            return x
        sizes = self.split(total)
        if x.shape[:-1].numel() == 0:
            return x.new_empty(*x.shape[:-1], total) if self.is_first else None
        x = F.pad(x, (0, sizes[0] - x.shape[-1])).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0)
        if not self.is_first:
            return None
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def split(self, total: int) -> list[int]:
        """``total`` items dealt to the ranks as evenly as possible, the larger shares first."""
        return [total // self.size + (r < total % self.size) for r in range(self.size)]

    def span(self, total: int) -> tuple[int, int]:
        """(first index, count) of this rank's share of ``total`` items (see ``split``)."""
        sizes = self.split(total)
        return sum(sizes[:self.rank]), sizes[self.rank]


SINGLE = ParallelState()


def init_group(rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float) -> ParallelState:
    """Join the group as ``rank`` (gloo on CPU, nccl on CUDA); every collective then fails after ``timeout_s``
    instead of waiting forever for a rank that hangs."""
    ensure_no_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return ParallelState(rank, size)


def ensure_no_group() -> None:
    """RuntimeError if this process is already in a group (the default group is per process)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: close the other "
                           "tensor-parallel engine first (one per process)")


def destroy_group() -> None:
    """Leave the group (a no-op outside one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
