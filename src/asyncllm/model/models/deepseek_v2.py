"""DeepSeek-V2 (`DeepseekV2ForCausalLM`, e.g. DeepSeek-V2-Lite): multi-head latent
attention (MLA) and a mixture of experts with shared experts.

Attention: queries through `q_proj` (or the low-rank `q_a_proj`, its norm and
`q_b_proj`), each head's `qk_nope_head_dim` values plus `qk_rope_head_dim` rotated ones
(GPT-J's interleaved rotation); keys and values compressed into one latent per token
(`kv_a_proj_with_mqa`: `kv_lora_rank` values, normalised, plus the shared rotary key),
which is all the KV cache holds; `kv_b_proj` up-projects it per head (`attention/mla.py`
says how decode and prefill use it). YaRN's `mscale_all_dim` scales the softmax as
transformers does.

MLP: the first `first_k_dense_replace` layers dense; the others route each token to
`num_experts_per_tok` of `n_routed_experts` by a float32 softmax router ("greedy" or
"group_limited_greedy" top-k, weights times `routed_scaling_factor`) and add
`n_shared_experts` experts every token goes through (one MLP of their summed size).

Tensor and pipeline parallelism are refused (`engine/core_config.py`) until tested on
several GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.config import num_experts
from asyncllm.model.attention.backend import AttentionBackend
from asyncllm.model.attention.mla import MLABackend, MLALayerSpec
from asyncllm.model.layers.fused_moe import (
    FusedMoE,
    load_expert_weights,
    select_experts_grouped,
)
from asyncllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.model.layers.norm import RMSNorm
from asyncllm.model.layers.rotary import RotaryEmbedding, get_rope, rope_parameters, yarn_mscale
from asyncllm.model.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

TOPK_METHODS = ("greedy", "group_limited_greedy")


def mla_softmax_scale(config: Any) -> float:
    """1/sqrt(q/k head size), times YaRN's mscale(factor, mscale_all_dim) squared when the
    RoPE parameters say so (as transformers' `yarn_apply_mscale`)."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class DeepseekV2MLAAttention(nn.Module):
    latent_cache = True  # (the KV cache spec: one latent vector per token)

    def __init__(self, config: Any, backend: AttentionBackend, rotary_emb: RotaryEmbedding):
        super().__init__()
        if not isinstance(backend, MLABackend):
            raise TypeError(f"attention backend {backend.name!r} cannot run latent attention (MLA)")
        self.backend = backend
        hidden, H = int(config.hidden_size), int(config.num_attention_heads)
        self.num_heads = H
        self.nope, self.rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_head_dim, self.kv_lora_rank = int(config.v_head_dim), int(config.kv_lora_rank)
        qk_head = self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.q_proj: nn.Module | None = None
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, H * qk_head, bias=False)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, int(self.q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(int(self.q_lora_rank), H * qk_head, bias=False)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.kv_lora_rank + self.rope, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        # Used as per-head matrices, never as a linear layer (so never packed on the CPU).
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(H * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = rotary_emb
        self.spec = MLALayerSpec(
            num_heads=H,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.nope,
            qk_rope_head_dim=self.rope,
            v_head_dim=self.v_head_dim,
            scale=mla_softmax_scale(config),
        )
        # The KV cache spec's view: one "head" of the cached vector.
        self.num_kv_heads, self.head_dim = 1, self.spec.cache_size

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any
    ) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, H, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        # (on CUDA rotated in place, inside q and the latent projection)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        out = self.backend.forward_mla(
            self.spec, q_nope, q_pe, kv_c, k_pe, kv_cache, attn_metadata, w_uk, w_uv
        )
        return self.o_proj(out.reshape(T, H * self.v_head_dim))


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method {method!r} is not supported (supported: {TOPK_METHODS})")
        self.grouped = method == "group_limited_greedy"
        self.num_groups = getattr(config, "n_group", None)
        self.topk_groups = getattr(config, "topk_group", None)
        self.scaling = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        E, hidden = num_experts(config), int(config.hidden_size)
        # The router stays float32 whatever the model's dtype (as in transformers).
        self.gate = nn.Linear(hidden, E, bias=False, dtype=torch.float32)
        self.experts = FusedMoE(
            num_experts=E,
            top_k=int(config.num_experts_per_tok),
            hidden_size=hidden,
            intermediate_size=int(config.moe_intermediate_size),
            renormalize=False,
            round_weights=False,
            scaling=self.scaling,
        )
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = (
            LlamaMLP(config, int(config.moe_intermediate_size) * shared) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        if self.grouped:
            weights, ids = select_experts_grouped(
                logits, self.experts.top_k, self.num_groups, self.topk_groups, self.scaling
            )
            out = self.experts.apply_experts(x, weights, ids)
        else:
            out = self.experts(x, logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # (no fused q/k/v: only the dense and shared MLPs' gate and up are merged)
    stacked_params = (
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def build_model(self, config: Any, backend: AttentionBackend, qkv_bias: bool) -> LlamaModel:
        # One rotary table for every layer (YaRN's reaches 160k positions).
        rotary = get_rope(
            int(config.qk_rope_head_dim),
            int(config.max_position_embeddings),
            rope_parameters(config),
            is_neox_style=False,
        )
        first_sparse = int(getattr(config, "first_k_dense_replace", 0) or 0)

        def make_layer(i: int) -> nn.Module:
            mlp = LlamaMLP(config) if i < first_sparse else DeepseekV2MoE(config)
            attn = DeepseekV2MLAAttention(config, backend, rotary)
            return LlamaDecoderLayer(config, i, backend, False, False, mlp=mlp, self_attn=attn)

        return LlamaModel(config, self.stage, self.tie_word_embeddings, make_layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The routed experts' tensors into their stacked weights; the others (the
        shared experts' gate/up merged as Llama's MLP) as Llama's."""
        loaded: set[str] = set()
        loaded |= super().load_weights(load_expert_weights(self, weights, loaded))
        return loaded
