"""Tensor-parallel group state that the sharded layers read.

With no distributed group set up, the world is one rank: every layer holds the
whole weight and no collective runs. `set_tensor_parallel` is how a multi-rank
worker tells the layers their rank and group once torch.distributed is initialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_TP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def set_tensor_parallel(rank: int, world_size: int, group: dist.ProcessGroup | None) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {world_size})")
    global _TP
    _TP = TensorParallelGroup(rank=rank, world_size=world_size, group=group)
