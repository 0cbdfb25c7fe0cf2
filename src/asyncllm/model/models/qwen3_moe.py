"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norm),
and on its sparse layers a mixture of experts in place of the MLP: a linear router
over `num_experts`, the `num_experts_per_tok` best of a softmax, renormalised when
`norm_topk_prob`, no shared expert. A layer is sparse unless `mlp_only_layers` lists
it or `decoder_sparse_step` skips it; the others keep a dense MLP.

Checkpoints hold each expert's projections apart (`mlp.experts.{e}.gate_proj.weight`);
they load into the layer's stacked weights (`layers/fused_moe.py`). Tensor parallelism
is refused until tested on several GPUs (the experts would be sharded by their
intermediate size)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from asyncllm.config import num_experts
from asyncllm.distributed.parallel_state import get_tp_group
from asyncllm.model.attention.backend import AttentionBackend
from asyncllm.model.layers.fused_moe import FusedMoE, load_expert_weights
from asyncllm.model.layers.linear import ReplicatedLinear
from asyncllm.model.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel, Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether a Qwen3-MoE layer has experts (as transformers decides it)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts(config) > 0
        and (layer + 1) % step == 0
    )


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config), bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts(config),
            top_k=int(config.num_experts_per_tok),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.moe_intermediate_size),
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: Any, backend: AttentionBackend):
        tp = get_tp_group().world_size
        if tp > 1:
            raise ValueError(
                f"{type(self).__name__} does not run at tensor_parallel_size > 1 yet "
                f"(asked for {tp}): mixture-of-experts layers are not sharded"
            )
        super().__init__(config, backend)

    def build_model(self, config: Any, backend: AttentionBackend, qkv_bias: bool) -> LlamaModel:
        def make_layer(i: int) -> nn.Module:
            mlp = Qwen3MoeSparseBlock(config) if is_sparse_layer(config, i) else LlamaMLP(config)
            return LlamaDecoderLayer(config, i, backend, qkv_bias, self.qk_norm, mlp=mlp)

        return LlamaModel(config, self.stage, self.tie_word_embeddings, make_layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The experts' tensors into their stacked weights; the others as Llama's."""
        loaded: set[str] = set()
        loaded |= super().load_weights(load_expert_weights(self, weights, loaded))
        return loaded
