"""Pipeline-parallel stages of a model: which decoder layers a rank holds, placeholders
for the others, and the tensors that pass from one stage to the next.

A model of N decoder layers over P stages gives stage p the contiguous layers
`stage_layers(N, p, P)`. The even split gives every stage N // P layers and the
N % P layers left over to the stages before the last, one each, from the
second-to-last backwards (as vLLM splits them: the last stage also holds the final
norm and the LM head). `ASYNCLLM_PP_LAYER_PARTITION` (e.g. "12,12", one count per
stage, summing to N) overrides the split; it is read only when there are several
stages. Every stage holds at least one layer.

The first stage embeds the tokens; every stage but the last hands the next one its
hidden states and residual as a tensor dict (`IntermediateTensors`, the shape
`GroupCoordinator.send_tensor_dict` sends); the last stage applies the final norm and
returns hidden states for the LM head. Modules a stage does not hold are
`PPMissingLayer`s: no parameters, no KV cache, and their checkpoint tensors are
skipped on loading. At one stage nothing changes: every layer is local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from asyncllm import envs
from asyncllm.distributed.parallel_state import get_pp_group

# The variable's name sits in a constant: asyncllm.envs is the place for ASYNCLLM_*
# reads, and this one moves there (`envs.pp_layer_partition()`) with its documentation.
PP_LAYER_PARTITION_ENV = envs.PP_LAYER_PARTITION

# What passes between stages: {"hidden_states": [T, hidden], "residual": [T, hidden]}.
IntermediateTensors = dict[str, torch.Tensor]
HIDDEN_STATES = "hidden_states"
RESIDUAL = "residual"


def stage_partition(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """The number of layers each of `pp_size` stages holds, in stage order.

    `partition` ("12,12") overrides the even split; ValueError when it does not name
    one positive count per stage summing to `num_layers`, or when there are more stages
    than layers.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"cannot split {num_layers} layers over {pp_size} pipeline stages: "
            "every stage needs at least one layer"
        )
    if partition is not None:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={partition!r} is not a comma-separated list of "
                "layer counts, e.g. '12,12'"
            ) from None
        if len(counts) != pp_size:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={partition!r} names {len(counts)} stages, "
                f"but pipeline_parallel_size is {pp_size}"
            )
        if any(c < 1 for c in counts):
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={partition!r}: every stage needs at least one layer"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={partition!r} sums to {sum(counts)} layers, "
                f"but the model has {num_layers}"
            )
        return counts
    counts = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):  # < pp_size: never the last stage
        counts[pp_size - 2 - i] += 1
    return counts


def stage_layers(
    num_layers: int, pp_rank: int, pp_size: int, partition: str | None = None
) -> tuple[int, int]:
    """(start, end): the layers [start, end) stage `pp_rank` of `pp_size` holds.

    `partition` None reads ASYNCLLM_PP_LAYER_PARTITION (at `pp_size` > 1 only); see
    `stage_partition` for the split and its refusals.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside {pp_size} stages")
    if partition is None and pp_size > 1:
        partition = envs.pp_layer_partition()
    counts = stage_partition(num_layers, pp_size, partition)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


@dataclass(frozen=True)
class PipelineStage:
    """The stage a rank holds: layers [start_layer, end_layer) of the model's
    `num_layers`, stage `rank` of `size`."""

    rank: int
    size: int
    start_layer: int
    end_layer: int
    num_layers: int

    @classmethod
    def of_this_rank(cls, num_layers: int) -> PipelineStage:
        """This process's stage, from the pipeline group (`get_pp_group()`)."""
        pp = get_pp_group()
        start, end = stage_layers(num_layers, pp.rank_in_group, pp.world_size)
        return cls(pp.rank_in_group, pp.world_size, start, end, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)


class PPMissingLayer(nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters, no buffers,
    and calling it is an error (a stage runs only its own modules)."""

    def __init__(self, what: str = "this module") -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(f"{self.what} belongs to another pipeline stage")

    def extra_repr(self) -> str:
        return self.what


def make_layers(stage: PipelineStage, layer_fn: Callable[[int], nn.Module]) -> nn.ModuleList:
    """All `stage.num_layers` layers, by global index: `layer_fn(i)` for the stage's
    own, a `PPMissingLayer` for the others (so parameter names match the checkpoint's)."""
    return nn.ModuleList(
        layer_fn(i) if stage.start_layer <= i < stage.end_layer else PPMissingLayer(f"layer {i}")
        for i in range(stage.num_layers)
    )


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes ("model.layers.5.") of every `PPMissingLayer` in `model`: a
    checkpoint tensor under one belongs to another stage."""
    return tuple(
        f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer)
    )


__all__ = [
    "HIDDEN_STATES",
    "PP_LAYER_PARTITION_ENV",
    "RESIDUAL",
    "IntermediateTensors",
    "PPMissingLayer",
    "PipelineStage",
    "make_layers",
    "missing_prefixes",
    "stage_layers",
    "stage_partition",
]
