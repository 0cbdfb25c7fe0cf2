"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences, read from
the config.

- Embeddings scaled by the square root of the hidden size (rounded to the dtype).
- RMSNorm scaled by 1 + weight, computed in float32 (`GemmaRMSNorm`), four per decoder
  layer: before and after attention, before and after the MLP.
- Attention scaled by `query_pre_attn_scalar`^-1/2, its logits soft-capped
  (`attn_logit_softcapping`, Gemma 2), a sliding window on the layers `layer_types`
  marks "sliding_attention" (Gemma 2 alternates; Gemma 3 has five local layers per
  global one), and on Gemma 3 a q/k norm and RoPE parameters per layer type (a local
  base on windowed layers, the global base and scaling on the others).
- A GELU (tanh) gated MLP; the LM head tied to the embeddings; the final logits
  soft-capped (`final_logit_softcapping`, Gemma 2).

The windowed layers form KV cache groups of their own (`model/kv_groups.py`), which
free the blocks that fall out of the window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from asyncllm.model.attention.backend import AttentionBackend, AttentionLayerSpec
from asyncllm.model.kv_groups import layer_sliding_window
from asyncllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncllm.model.layers.rotary import get_rope, rope_parameters
from asyncllm.model.models.llama import (
    LlamaForCausalLM,
    LlamaModel,
    PagedSelfAttention,
)


def input_norm(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm with the residual stream: the first layer's residual
    is its input; later ones add the stream first (the norm fuses the add)."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype once; with a residual,
    `(norm(x + residual), x + residual)` (the sum in x's dtype, as the reference adds)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total


def _layer_type(config: Any, layer: int) -> str:
    types = getattr(config, "layer_types", None)
    if not types:
        raise ValueError(f"{config.architectures}: the config lists no layer_types")
    return str(types[layer])


class GemmaAttention(PagedSelfAttention):
    def __init__(self, config: Any, layer: int, backend: AttentionBackend, qk_norm: bool):
        super().__init__()
        self.backend = backend
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, total_heads, total_kv, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        layer_type = _layer_type(config, layer)
        self.rotary_emb = get_rope(
            head_dim, config.max_position_embeddings, rope_parameters(config, layer_type)
        )
        self.spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=head_dim,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=layer_sliding_window(config, layer),
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )


class GemmaMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')"
            )
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer: int, backend: AttentionBackend, qk_norm: bool):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer, backend, qk_norm)
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, residual, kv_cache, attn_metadata):
        x, residual = input_norm(self.input_layernorm, x, residual)
        x = self.self_attn(positions, x, kv_cache, attn_metadata)
        x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (see the module docstring)."""

    qk_norm = False

    def build_model(self, config: Any, backend: AttentionBackend, qkv_bias: bool) -> LlamaModel:
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)
        return LlamaModel(
            config,
            self.stage,
            self.tie_word_embeddings,
            lambda i: GemmaDecoderLayer(config, i, backend, self.qk_norm),
            norm_cls=GemmaRMSNorm,
            embed_scale=float(config.hidden_size) ** 0.5,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_soft_cap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: Gemma 2's layout with a q/k norm and RoPE per layer type."""

    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 multimodal checkpoint, run alone (text in, text
    out; images are not supported): its config is the checkpoint's `text_config`
    (`engine/core_config.py`), its weights those under `language_model` (as transformers
    names them before 4.52 and after); the vision tower and projector are not read."""

    # checkpoint prefix -> ours
    text_prefixes = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    )

    def _text_name(self, checkpoint_name: str) -> str | None:
        """Our checkpoint name for a text-model weight; None for the others."""
        for prefix, ours in self.text_prefixes:
            if checkpoint_name.startswith(prefix):
                return ours + checkpoint_name[len(prefix) :]
        return None

    def holds_weight(self, checkpoint_name: str) -> bool:
        name = self._text_name(checkpoint_name)
        return name is not None and super().holds_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        text = ((self._text_name(n), w) for n, w in weights)
        return super().load_weights((n, w) for n, w in text if n is not None)
