"""A mixture-of-experts MLP: a router picks each token's experts, and the experts'
gate/up and down projections run as grouped GEMMs over the tokens sorted by expert
(`asyncllm_kernels.fused_moe`; off CUDA, its plain-torch reference `fused_moe_ref`,
expert by expert).

The experts' weights are held stacked: `w13` [E, 2I, H] (each expert's gate then up
projection) and `w2` [E, H, I]; a checkpoint's per-expert tensors load into their slice
(`load_expert`).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm_kernels.reference import fused_moe_ref


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the k highest softmax scores of each
    token, renormalised to sum to 1 when asked (Qwen3-MoE's `norm_topk_prob`)."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


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
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
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
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        weights = weights.to(x.dtype)  # (as the reference models round them)
        if x.is_cuda:
            from asyncllm_kernels.fused_moe import fused_moe  # (imports triton)

            return fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return fused_moe_ref(x, self.w13_weight, self.w2_weight, weights, ids)
