"""The memory-bandwidth floor of one decode step, from a Hugging Face config alone.

A batch-1 decode step reads every weight matrix once, except the input embedding table,
of which it gathers one row; the LM head is read in full (with tied embeddings it is the
embedding table, counted once). It also reads the KV cache of the whole context. Divided
by the memory bandwidth this gives the fastest a step can be, whatever the kernels do.

A mixture-of-experts layer (Qwen3-MoE, DeepSeek-V2) holds all its experts but a step
reads only the ones its tokens are routed to: at batch 1 the `num_experts_per_tok`
chosen ones, in a batch of B tokens the distinct experts they choose (`active_experts`:
under uniform routing, E * (1 - (1 - k/E)^B) on average), plus DeepSeek's shared experts,
which every token goes through.

A latent-attention model (MLA: DeepSeek-V2) caches one vector of `kv_lora_rank +
qk_rope_head_dim` values per token and layer instead of K and V, and its attention
weights are the low-rank projections (`q_a/q_b` or `q_proj`, `kv_a_proj_with_mqa`,
`kv_b_proj`, `o_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from asyncllm.config import num_experts

H200_HBM_BYTES_PER_S = 4.3e12  # about 90% of the H200's 4.8 TB/s HBM3e peak


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2, or attention_bias
    o_bias: bool = False  # attention_bias (Llama, Qwen3)
    qk_norm: bool = False  # Qwen3: an RMSNorm weight of head_dim on q and on k
    mlp_bias: bool = False
    # mixture of experts (Qwen3-MoE): experts per sparse layer, chosen per token, their
    # width, and how many layers are sparse (the others keep the dense MLP)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0
    shared_intermediate: int = 0  # DeepSeek's shared experts, one MLP of their summed width
    # latent attention (MLA); kv_lora_rank 0: ordinary attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: a full-rank q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or a config.json dict."""
        if isinstance(config, dict):
            config = SimpleNamespace(**config)
        get_text = getattr(config, "get_text_config", None)
        if callable(get_text):
            config = get_text()
        model_type = str(getattr(config, "model_type", "") or "")
        archs = getattr(config, "architectures", None) or [""]
        arch = str(archs[0])
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        is_qwen3 = model_type.startswith("qwen3") or arch.startswith("Qwen3")
        layers = int(config.num_hidden_layers)
        experts = num_experts(config)
        sparse = 0
        if experts:
            step = int(getattr(config, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(config, "mlp_only_layers", None) or [])
            first = int(getattr(config, "first_k_dense_replace", 0) or 0)
            sparse = sum(
                1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first
            )
        moe_inter = int(getattr(config, "moe_intermediate_size", 0) or 0)
        shared = int(getattr(config, "n_shared_experts", 0) or 0) * moe_inter
        latent = int(getattr(config, "kv_lora_rank", 0) or 0)
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or is_qwen2,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=is_qwen3,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            num_experts=experts,
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
            moe_intermediate=moe_inter,
            sparse_layers=sparse,
            shared_intermediate=shared,
            kv_lora_rank=latent,
            q_lora_rank=int(getattr(config, "q_lora_rank", 0) or 0) if latent else 0,
            qk_nope_head_dim=int(getattr(config, "qk_nope_head_dim", 0) or 0) if latent else 0,
            qk_rope_head_dim=int(getattr(config, "qk_rope_head_dim", 0) or 0) if latent else 0,
            v_head_dim=int(getattr(config, "v_head_dim", 0) or 0) if latent else 0,
        )

    def expert_parameters(self) -> int:
        """One expert's parameters (gate, up and down projections)."""
        return 3 * self.hidden * self.moe_intermediate

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part; `total` is what the model holds (a tied LM head is the
        embedding table, so it is not counted twice). With experts, `per_layer` is a
        dense layer's and `experts` all sparse layers' experts and routers."""
        h, d = self.hidden, self.head_dim
        if self.kv_lora_rank:
            attn = self.latent_attention_parameters()
        else:
            q, kv = self.heads * d, self.kv_heads * d
            attn = h * (q + 2 * kv) + q * h
            if self.qkv_bias:
                attn += q + 2 * kv
            if self.o_bias:
                attn += h
            if self.qk_norm:
                attn += 2 * d
        mlp = 3 * h * self.intermediate
        if self.mlp_bias:
            mlp += 2 * self.intermediate + h
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embedding = self.vocab * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab * h
        router = self.num_experts * h
        shared = 3 * h * self.shared_intermediate
        experts = self.sparse_layers * (
            self.num_experts * self.expert_parameters() + router + shared
        )
        # (a sparse layer has no dense MLP)
        layers = self.layers * per_layer - self.sparse_layers * mlp + experts
        return {
            "embedding": embedding,
            "lm_head": lm_head,
            "per_layer": per_layer,
            "experts": experts,
            "layers": layers,
            "final_norm": h,
            "total": embedding + lm_head + layers + h,
        }

    def latent_attention_parameters(self) -> int:
        """One MLA layer's attention weights (biases aside)."""
        h, heads, r = self.hidden, self.heads, self.kv_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        else:
            q = h * heads * qk
        kv = (
            h * (r + self.qk_rope_head_dim)
            + r
            + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return q + kv + heads * self.v_head_dim * h

    def active_experts(self, num_tokens: float) -> float:
        """Experts of one sparse layer a step of `num_tokens` tokens reads, on average
        under uniform routing (at one token, exactly `experts_per_token`)."""
        e, k = self.num_experts, self.experts_per_token
        if not e:
            return 0.0
        if num_tokens <= 1:
            return float(k)
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    def streamed_parameters(self, num_tokens: float = 1) -> int:
        """Parameters a decode step of `num_tokens` tokens reads: all but the gathered
        embedding table (which with tied embeddings is read anyway, as the LM head) and
        the experts no token is routed to."""
        counts = self.parameter_counts()
        total = counts["total"]
        if not self.tie_word_embeddings:
            total -= counts["embedding"]
        idle = self.num_experts - self.active_experts(num_tokens)
        return int(total - self.sparse_layers * idle * self.expert_parameters())

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.kv_lora_rank:  # (one latent vector per token and layer)
            return self.layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def decode_step_bytes(shape: ModelShape, dtype_bytes: int, context_len: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads: the streamed weights, and the KV cache of
    `context_len` tokens."""
    weights = shape.streamed_parameters() * dtype_bytes
    kv = context_len * shape.kv_bytes_per_token(dtype_bytes)
    return {"weights": float(weights), "kv": float(kv), "total": float(weights + kv)}


def decode_floor(
    shape: ModelShape,
    dtype_bytes: int,
    input_len: int,
    output_len: int,
    bandwidth: float = H200_HBM_BYTES_PER_S,
) -> dict[str, float]:
    """The bandwidth floor of batch-1 decoding `output_len` tokens after `input_len`,
    at the average context length input_len + output_len / 2."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    step = decode_step_bytes(shape, dtype_bytes, input_len + output_len / 2)
    seconds = step["total"] / bandwidth
    return {
        "weight_bytes": step["weights"],
        "kv_bytes": step["kv"],
        "bytes_per_step": step["total"],
        "bandwidth_bytes_per_s": float(bandwidth),
        "floor_ms_per_token": seconds * 1e3,
        "floor_tok_s": 1.0 / seconds,
    }
