"""Linear layers sharded over the tensor-parallel group.

Each layer reads `get_tp_group()` when it is built (so the model is built after
`initialize_model_parallel`) and sizes its parameters for its rank: column-parallel
layers hold a slice of the output rows (QKV by head, merged gate/up by each part),
row-parallel layers a slice of the input columns and all-reduce their partial sums.
Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that
copies only the rank's slice of a full checkpoint tensor into it, so checkpoints stream
straight into sharded parameters. At tensor-parallel size 1 the slice is the whole.
A size the group cannot shard is refused at construction with a ValueError naming it.

At decode batches of at most 16 rows on CUDA (16-bit, no bias) a layer can take in its
neighbours' launches through the skinny GEMM kernel (asyncllm_kernels/skinny_gemm.py):
the RMSNorm before it (an input given as a `PendingNorm` of a norm folded into this
layer's weight: `RMSNorm.fold_into`, done at load time), silu(gate) * up after the
merged gate/up projection (`gated`), and the residual add after a row-parallel layer at
tensor-parallel size 1 (`forward_into`). Elsewhere each runs in its own launch, with the
same result up to rounding. Off unless `ASYNCLLM_FUSED_GEMM=1`: measured slower so far
(docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import envs
from asyncllm.distributed.parallel_state import get_tp_group
from asyncllm.model.layers.activation import silu_and_mul
from asyncllm.model.layers.norm import PendingNorm


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


def shard_attention_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int, int]:
    """(query heads per rank, KV heads per rank, ranks sharing each KV head).

    Query heads split evenly; KV heads split evenly when there are at least as many as
    ranks, else each is replicated on `tp_size // num_kv_heads` ranks.
    """
    numbers = (
        f"{num_heads} attention heads and {num_kv_heads} KV heads "
        f"over a tensor-parallel size of {tp_size}"
    )
    if num_heads % num_kv_heads:
        raise ValueError(f"cannot shard {numbers}: the KV heads do not divide the heads")
    if num_heads % tp_size:
        raise ValueError(f"cannot shard {numbers}: {num_heads} is not divisible by {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"cannot shard {numbers}: {num_kv_heads} is not divisible by {tp_size}"
            )
        return num_heads // tp_size, num_kv_heads // tp_size, 1
    if tp_size % num_kv_heads:
        raise ValueError(
            f"cannot shard {numbers}: the KV heads are replicated when fewer than the "
            f"ranks, so {tp_size} must be a multiple of {num_kv_heads}"
        )
    return num_heads // tp_size, 1, tp_size // num_kv_heads


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Tags a parameter for loading (`weight_loader`, `checkpoint_name`): torch lets a
    tensor carry attributes, which its type stubs do not declare."""
    for name, value in attrs.items():
        setattr(param, name, value)


def _param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    set_weight_attrs(p, weight_loader=loader)
    return p


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a float32 weight: 1.5-2x faster than F.linear at
    decode batch sizes on the CPU (see docs/benchmarks.md)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _param((output_size, input_size), self.weight_loader)
        self.bias = _param((output_size,), self.weight_loader) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.fuse_neighbours = envs.fused_gemm()

    def pack_for_cpu(self) -> None:
        """Called once the weights are loaded: the layer computes with the packed copy
        from then on, and the parameter gives up its storage (keeping both held the
        layer's weights twice). Its shape stays in `input_size` and `output_size`."""
        self.packed_weight = pack_weight(self.weight)
        self.weight.data = self.weight.data.new_empty((0,))

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        if x.is_cuda and bias is None and x.dim() == 2 and x.stride(1) == 1:
            # Small decode batches of the shapes tuned for it: the skinny GEMM kernel.
            from asyncllm_kernels.skinny_gemm import skinny_config, skinny_gemm

            n, k = self.weight.shape
            config = skinny_config(x.shape[0], n, k, x.dtype)
            if config is not None:
                return skinny_gemm(x, self.weight, config)
        return F.linear(x, self.weight, bias)

    def _small_batch(
        self,
        x: torch.Tensor | PendingNorm,
        gated: bool = False,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """This layer in one skinny GEMM launch with its neighbours (the pending norm of
        x, the gate, the add into `add_to`), or None where that kernel does not apply;
        the caller then runs them apart."""
        pending = x if isinstance(x, PendingNorm) else None
        t = pending.residual if pending is not None else x
        assert isinstance(t, torch.Tensor)
        if not (self.fuse_neighbours and t.is_cuda and self.bias is None):
            return None
        from asyncllm_kernels.skinny_gemm import (
            MAX_M,
            device_sms,
            fused_config,
            fused_supported,
            skinny_gemm,
        )

        if not (
            t.dim() == 2
            and 1 <= t.shape[0] <= MAX_M
            and t.dtype in (torch.bfloat16, torch.float16)
            and t.stride(1) == 1
            and (add_to is None or (add_to.dtype == t.dtype and add_to.stride(1) == 1))
            and (pending is None or pending.norm.folded)
            and fused_supported(t.device)
        ):
            return None

        n, k = self.weight.shape
        norm = pending is not None
        config = fused_config(t.shape[0], n, k, t.dtype, gated, device_sms(t.device), norm=norm)
        return skinny_gemm(
            pending.stream() if pending is not None else t,
            self.weight,
            config,
            norm=norm,
            eps=pending.norm.eps if pending is not None else 0.0,
            gated=gated,
            add_to=add_to,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded, getattr(param, "checkpoint_name", "?"))
        param.data.copy_(loaded)


class ReplicatedLinear(LinearBase):
    """Y = X A with the whole of A on every rank (a mixture-of-experts router). Like the
    sharded layers, it runs on the skinny GEMM kernel at the small batches of a shape
    tuned for it."""


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split along its output dimension; each rank holds a slice of Y."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        tp = get_tp_group()
        self.full_output_size = output_size
        super().__init__(input_size, _divide(output_size, tp.world_size, "output size"), bias)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            y = None if self.gather_output else self._small_batch(x)
            if y is not None:
                return y
            x = x.resolve()
        y = super().forward(x)
        return self.tp.all_gather(y, -1) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        name = getattr(param, "checkpoint_name", "?")
        expected = (size * self.tp.world_size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        param.data.copy_(loaded.narrow(0, self.tp.rank_in_group * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up) stored in one weight.

    `shard_id` is the index of the checkpoint tensor among `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        self.output_sizes = list(output_sizes)
        self.shard_sizes = [_divide(s, tp_size, "merged output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        name = getattr(param, "checkpoint_name", "?")
        if shard_id is None:  # the parts already merged, one after the other
            expected = (sum(self.output_sizes), *param.shape[1:])
            if tuple(loaded.shape) != expected:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
                )
            for i, part in enumerate(loaded.split(self.output_sizes)):
                self.weight_loader(param, part, i)
            return
        offset, size = sum(self.shard_sizes[:shard_id]), self.shard_sizes[shard_id]
        expected = (self.output_sizes[shard_id], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        rank = self.tp.rank_in_group
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def gated(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        """silu(gate) * up of the two outputs (gate, then up): in the GEMM's own launch
        at small batches, else by `silu_and_mul` after it."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"gated needs two equal outputs, not {self.output_sizes}")
        if not self.gather_output:
            y = self._small_batch(x, gated=True)
            if y is not None:
                return y
        if isinstance(x, PendingNorm):
            x = x.resolve()
        return silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight, sharded by attention head.

    Each rank holds `num_heads` query heads and `num_kv_heads` KV heads, laid out
    [q | k | v]. With fewer KV heads than ranks, each KV head is replicated on
    `kv_replicas` consecutive ranks so that every rank has one.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = get_tp_group()
        self.head_size = head_size
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads, self.num_kv_heads, self.kv_replicas = shard_attention_heads(
            num_heads, num_kv_heads, tp.world_size
        )
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp.world_size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("QKVParallelLinear loads q, k and v separately")
        tp, d = self.tp, self.head_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, total, rank = 0, q_size, self.total_num_heads * d, tp.rank_in_group
        elif shard_id in ("k", "v"):
            offset = q_size + (0 if shard_id == "k" else kv_size)
            size, total = kv_size, self.total_num_kv_heads * d
            rank = tp.rank_in_group // self.kv_replicas
        else:
            raise ValueError(f"unknown QKV shard {shard_id!r}")
        name = getattr(param, "checkpoint_name", "?")
        expected = (total, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split along its input dimension; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp_group()
        super().__init__(_divide(input_size, tp.world_size, "input size"), output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, None)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def forward_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """Adds the output into `residual` in the GEMM's own launch where it can (then
        None), else returns the output, for the next norm to add with its own."""
        if self.tp.world_size == 1 and residual.shape == (x.shape[0], self.output_size):
            if self._small_batch(x, add_to=residual) is not None:
                return None
        return self(x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        name = getattr(param, "checkpoint_name", "?")
        if param.dim() == 1:  # bias: replicated
            _check_shape(param, loaded, name)
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        expected = (param.shape[0], size * self.tp.world_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        param.data.copy_(loaded.narrow(1, self.tp.rank_in_group * size, size))
