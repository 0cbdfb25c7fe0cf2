"""The Llama family: Llama 2/3/3.1 (SmolLM), Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm).

One implementation; the differences are switches read from the config. The model
takes a flat batch of tokens (all sequences' chunks back to back) with their
positions, writes K/V into the paged cache and attends through the backend.

Under pipeline parallelism a rank builds only its stage (`model/pipeline.py`): its
decoder layers, the embedding on the first stage (and on the last when the LM head is
tied to it: that stage holds the table as its LM head), the final norm and the LM head
on the last; the rest are placeholders without weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from asyncllm.model.attention.backend import AttentionBackend, AttentionLayerSpec
from asyncllm.model.interface import CausalLM, KVCacheSpec
from asyncllm.model.kv_groups import layer_sliding_window
from asyncllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    set_weight_attrs,
)
from asyncllm.model.layers.norm import PendingNorm, RMSNorm
from asyncllm.model.layers.rotary import RotaryEmbedding, get_rope, rope_parameters
from asyncllm.model.pipeline import (
    HIDDEN_STATES,
    RESIDUAL,
    IntermediateTensors,
    PipelineStage,
    PPMissingLayer,
    make_layers,
    missing_prefixes,
)


class PagedSelfAttention(nn.Module):
    """Self-attention over the paged cache, as the subclasses build it: `qkv_proj`, an
    optional per-head `q_norm`/`k_norm`, `rotary_emb`, the backend with its layer
    `spec`, and `o_proj`."""

    backend: AttentionBackend
    qkv_proj: QKVParallelLinear
    o_proj: RowParallelLinear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rotary_emb: nn.Module
    spec: AttentionLayerSpec
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int
    kv_size: int

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | PendingNorm,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The attention block's output; with a `residual`, added into it where the output
        projection's launch can (then None: layers/linear.py)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T = qkv.shape[0]
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm, self.k_norm)  # (on CUDA, in the rotation's launch)
        slots = self.backend.fused_kv_slots(attn_metadata)
        rotated = None
        if slots is not None and isinstance(self.rotary_emb, RotaryEmbedding):
            # One launch for the norms, the rotation and the KV cache write, where it can.
            rotated = self.rotary_emb.into_kv_cache(positions, q, k, v, norms, kv_cache, slots)
        if rotated is not None:
            out = self.backend.forward_cached(self.spec, rotated, kv_cache, attn_metadata)
        else:
            q, k = self.rotary_emb(positions, q, k, norms)
            out = self.backend.forward(self.spec, q, k, v, kv_cache, attn_metadata)
        out = out.reshape(T, self.q_size)
        if residual is not None:
            return self.o_proj.forward_into(out, residual)
        return self.o_proj(out)


class LlamaAttention(PagedSelfAttention):
    def __init__(
        self, config: Any, layer: int, backend: AttentionBackend, qkv_bias: bool, qk_norm: bool
    ):
        super().__init__()
        self.layer = layer
        self.backend = backend
        total_heads = config.num_attention_heads
        total_kv = getattr(config, "num_key_value_heads", None) or total_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, total_heads, total_kv, bias=qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(total_heads * head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = get_rope(
            head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer),
        )


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor | PendingNorm, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The MLP's output; with a `residual`, added into it where the down projection's
        launch can (then None)."""
        h = self.gate_up_proj.gated(x)
        if residual is not None:
            return self.down_proj.forward_into(h, residual)
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer: int,
        backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: bool,
        mlp: nn.Module | None = None,
        self_attn: nn.Module | None = None,
    ):
        """`mlp`: the layer's MLP (default: Llama's, of the config's intermediate size);
        `self_attn`: its attention (default: Llama's; DeepSeek's latent attention)."""
        super().__init__()
        self.self_attn = (
            self_attn
            if self_attn is not None
            else LlamaAttention(config, layer, backend, qkv_bias, qk_norm)
        )
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, attn_metadata):
        """(x, residual) -> (x, residual), x being what the residual stream still lacks:
        None where the last projection added its output in its own launch (Llama's own
        attention and MLP hand the norms to the projections after them and the
        residual to the ones before the adds; DeepSeek's latent attention and the
        mixture-of-experts blocks take normalized tensors)."""
        h = PendingNorm.of(self.input_layernorm, x, residual)
        residual = h.residual
        if isinstance(self.self_attn, PagedSelfAttention):
            x = self.self_attn(positions, h, kv_cache, attn_metadata, residual)
        else:
            x = self.self_attn(positions, h.resolve(), kv_cache, attn_metadata)
        h = PendingNorm(self.post_attention_layernorm, x, residual)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp(h, residual), residual
        return self.mlp(h.resolve()), residual

    def fold_norms(self) -> None:
        """Each norm's weight into the projection after it, where that one takes a
        PendingNorm (qkv; a Llama MLP's gate/up) and has no bias (the fused kernel
        has none): for the fused small-batch GEMMs."""
        if isinstance(self.self_attn, PagedSelfAttention) and self.self_attn.qkv_proj.bias is None:
            self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        if isinstance(self.mlp, LlamaMLP) and self.mlp.gate_up_proj.bias is None:
            self.post_attention_layernorm.fold_into(self.mlp.gate_up_proj)


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: `make_layer(i)` builds decoder layer i
    (a module taking and returning `(x, residual)`, x None where the residual holds the
    whole stream, with a `self_attn` that has
    `num_kv_heads` and `head_dim`, and `latent_cache` True for latent attention), `norm_cls` the final norm (fusing the residual add);
    `embed_scale` multiplies the embeddings (Gemma's square root of the hidden size)."""

    def __init__(
        self,
        config: Any,
        stage: PipelineStage,
        tie_word_embeddings: bool,
        make_layer: Callable[[int], nn.Module],
        norm_cls: Callable[[int, float], nn.Module] = RMSNorm,
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.stage = stage
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.hidden_size = config.hidden_size
        self.embed_scale = embed_scale
        self.embed_tokens: nn.Module
        if stage.is_first or (tie_word_embeddings and stage.is_last):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer("the embedding")
        self.layers = make_layers(stage, make_layer)
        # This stage's layers in order, beside the registered list (iterated each step).
        local = tuple(layer for layer in self.layers if not isinstance(layer, PPMissingLayer))
        self.local_layers = local
        self.norm: nn.Module
        if stage.is_last:
            self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer("the final norm")
        attn: Any = local[0].self_attn  # every layer has the same KV heads
        self.kv_cache_spec = KVCacheSpec(
            len(local),
            int(attn.num_kv_heads),
            int(attn.head_dim),
            first_layer=stage.start_layer,
            latent=bool(getattr(attn, "latent_cache", False)),
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first:
            x, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:  # (rounded to the dtype first, as in HF)
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        elif intermediate_tensors is None:
            raise ValueError(f"pipeline stage {self.stage.rank} needs the previous stage's tensors")
        else:
            x, residual = intermediate_tensors[HIDDEN_STATES], intermediate_tensors[RESIDUAL]
        if not isinstance(attn_metadata, list):  # (one metadata for every layer)
            attn_metadata = [attn_metadata] * len(kv_caches)
        for layer, kv_cache, metadata in zip(
            self.local_layers, kv_caches, attn_metadata, strict=True
        ):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        assert residual is not None  # (set by the first layer)
        if not self.is_last:
            if x is None:  # (the stream is whole: the next stage has nothing to add)
                x, residual = residual, torch.zeros_like(residual)
            return {HIDDEN_STATES: x, RESIDUAL: residual}
        if x is None:
            return self.norm(residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params: tuple[tuple[str, str, str | int], ...] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )
    qkv_bias_default = False
    qk_norm = False

    def __init__(self, config: Any, backend: AttentionBackend):
        super().__init__()
        self.config = config
        qkv_bias = bool(getattr(config, "attention_bias", False)) or self.qkv_bias_default
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.stage = PipelineStage.of_this_rank(config.num_hidden_layers)
        self.model = self.build_model(config, backend, qkv_bias)
        self.lm_head: nn.Module
        if self.stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings:
                embedding = self.model.embed_tokens
                assert isinstance(embedding, VocabParallelEmbedding)
                self.lm_head.tie_to(embedding)
        else:
            self.lm_head = PPMissingLayer("the LM head")
        # Checkpoint tensors under these names are other stages' (none at one stage).
        self._other_stages = missing_prefixes(self)
        for name, p in self.named_parameters():
            set_weight_attrs(p, checkpoint_name=name)

    def build_model(self, config: Any, backend: AttentionBackend, qkv_bias: bool) -> LlamaModel:
        """This stage's decoder stack (a subclass changes the layers)."""
        return LlamaModel(
            config,
            self.stage,
            self.tie_word_embeddings,
            lambda i: LlamaDecoderLayer(config, i, backend, qkv_bias, self.qk_norm),
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [T, hidden] for a flat batch of T tokens (on the last stage;
        an earlier stage returns the next one's tensors, see `CausalLM.forward`)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        shape = (num_tokens, self.model.hidden_size)
        return {
            HIDDEN_STATES: torch.empty(shape, dtype=dtype, device=device),
            RESIDUAL: torch.empty(shape, dtype=dtype, device=device),
        }

    def holds_weight(self, checkpoint_name: str) -> bool:
        return not (self._other_stages and checkpoint_name.startswith(self._other_stages))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Streams checkpoint tensors into parameters; returns the parameters loaded.

        Tensors of other pipeline stages are skipped. Unknown names and wrong shapes
        raise ValueError naming the tensor.
        """
        params = dict(self.named_parameters())
        other_stages = self._other_stages
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            if self.tie_word_embeddings and ckpt_name == "lm_head.weight":
                continue
            if other_stages and ckpt_name.startswith(other_stages):
                continue
            name, shard = self._parameter_for(ckpt_name)
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint has weight {ckpt_name!r}, which {type(self).__name__} does not have"
                )
            set_weight_attrs(param, checkpoint_name=ckpt_name)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded

    def _parameter_for(self, ckpt_name: str) -> tuple[str, str | int | None]:
        """Our parameter name for a checkpoint tensor, and its shard in a merged weight."""
        for fragment, ours, shard in self.stacked_params:
            if fragment in ckpt_name:
                return ckpt_name.replace(fragment, ours), shard
        return ckpt_name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layout; the sliding window comes from the config."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
