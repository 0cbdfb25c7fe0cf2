"""Tensor-parallel group state that the sharded layers read.

Only a world of one rank is set up today: every layer holds the whole weight and no
collective runs. The layers are written against this group so that a multi-rank
worker can give them their rank and process group.
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
