"""A mixture-of-experts MLP: a router picks each token's experts, and the experts'
gate/up and down projections run as grouped GEMMs over the tokens sorted by expert
(`asyncllm_kernels.fused_moe`; off CUDA, its plain-torch reference `fused_moe_ref`,
expert by expert).

The experts' weights are held stacked: `w13` [E, 2I, H] (each expert's gate then up
projection) and `w2` [E, H, I]; a checkpoint's per-expert tensors load into their slice
(`load_expert`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from asyncllm import envs
from asyncllm_kernels.reference import fused_moe_ref


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    round_to: torch.dtype | None = None,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the k highest softmax scores of each
    token, renormalised to sum to 1 when asked (Qwen3-MoE's `norm_topk_prob`), times
    `scaling`, rounded through `round_to` when given (a half type: the activations'). On
    CUDA one Triton launch (`asyncllm_kernels.fused_moe.softmax_topk`)."""
    round_to = _half_or_none(round_to)
    if router_logits.is_cuda:
        from asyncllm_kernels.fused_moe import softmax_topk  # (imports triton)

        return softmax_topk(router_logits, top_k, renormalize, scaling, round_to)
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    if round_to is not None:
        weights = weights.to(round_to).float()
    return weights, ids


def _half_or_none(dtype: torch.dtype | None) -> torch.dtype | None:
    # (float32 weights already round to float32 or wider)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def select_experts_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int | None,
    topk_groups: int | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing: (weights [T, k] float32, expert ids [T, k]). The k highest
    softmax scores ("greedy"); with `num_groups`, only among the experts of the
    `topk_groups` groups whose best expert scores highest ("group_limited_greedy"); the
    weights multiplied by `scaling` (`routed_scaling_factor`), not renormalised."""
    if not num_groups:
        return select_experts(router_logits.float(), top_k, False, scaling=scaling)
    if not topk_groups:
        raise ValueError("group-limited routing needs topk_group")
    scores = torch.softmax(router_logits.float(), dim=-1)
    T, E = scores.shape
    best = scores.view(T, num_groups, E // num_groups).amax(dim=-1)
    chosen = torch.topk(best, topk_groups, dim=-1).indices
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
    scores = scores.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return (weights * scaling if scaling != 1.0 else weights), ids


_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_expert_weights(
    model: Any, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Loads a checkpoint's per-expert tensors (`...mlp.experts.{e}.gate_proj.weight`)
    into the model's `FusedMoE` layers, adding the parameters to `loaded`; yields every
    other tensor (for the model's own loader). Another pipeline stage's experts are
    skipped (`model.holds_weight`)."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        m = _EXPERT.match(name)
        if m is None:
            yield name, tensor
            continue
        if not model.holds_weight(name):
            continue
        block = modules.get(f"{m.group(1)}.experts")
        if not isinstance(block, FusedMoE):
            raise ValueError(
                f"checkpoint has weight {name!r}, which {type(model).__name__} does not have"
            )
        param = block.load_expert(int(m.group(2)), m.group(3), tensor)
        loaded.add(f"{m.group(1)}.experts.{param}")


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated MLPs of `intermediate_size`; each token goes through
    its `top_k` experts, their outputs summed with the router's weights."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        round_weights: bool = True,
        scaling: float = 1.0,
    ) -> None:
        """`round_weights`: the routing weights are rounded to the activations' dtype
        before use (Qwen3-MoE's reference does; DeepSeek's keeps them float32).
        `scaling`: the routing weights' factor (DeepSeek's `routed_scaling_factor`)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.scaling = scaling
        self.route_in_gemm = envs.moe_routed()
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def load_expert(self, expert: int, projection: str, tensor: torch.Tensor) -> str:
        """Copies one expert's checkpoint tensor ("gate_proj", "up_proj" or "down_proj",
        as [out, in]) into its slice; returns the parameter's name. ValueError for an
        expert, a projection or a shape that does not fit."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the layer has {self.num_experts})")
        i = self.intermediate_size
        if projection == "down_proj":
            name, target = "w2_weight", self.w2_weight.data[expert]
        elif projection in ("gate_proj", "up_proj"):
            rows = slice(0, i) if projection == "gate_proj" else slice(i, 2 * i)
            name, target = "w13_weight", self.w13_weight.data[expert, rows]
        else:
            raise ValueError(f"unknown expert projection {projection!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {expert} {projection} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        return name

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Routes by softmax top-k (`select_experts`, the weights rounded to x's dtype
        with `round_weights`), then `apply_experts`. On CUDA with ASYNCLLM_MOE_ROUTED=1
        one call of `fused_moe_routed`, which at a few tokens routes inside the experts'
        first GEMM."""
        round_to = _half_or_none(x.dtype if self.round_weights else None)
        if x.is_cuda and self.route_in_gemm:
            from asyncllm_kernels.fused_moe import fused_moe_routed  # (imports triton)

            w13, w2, k = self.w13_weight, self.w2_weight, self.top_k
            return fused_moe_routed(
                x, w13, w2, router_logits, k, self.renormalize, self.scaling, round_to
            )
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, round_to, self.scaling
        )
        return self.apply_experts(x, weights, ids)

    def apply_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' outputs summed: weights (used as given, in float32) and
        expert ids [T, top_k]."""
        if x.is_cuda:
            from asyncllm_kernels.fused_moe import fused_moe  # (imports triton)

            return fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return fused_moe_ref(x, self.w13_weight, self.w2_weight, weights, ids)
