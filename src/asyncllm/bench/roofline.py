"""The memory-bandwidth floor of one decode step, from a Hugging Face config alone.

A batch-1 decode step reads every weight matrix once, except the input embedding table,
of which it gathers one row; the LM head is read in full (with tied embeddings it is the
embedding table, counted once). It also reads the KV cache of the whole context. Divided
by the memory bandwidth this gives the fastest a step can be, whatever the kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

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
        is_qwen3 = model_type == "qwen3" or arch.startswith("Qwen3")
        return cls(
            hidden=hidden,
            layers=int(config.num_hidden_layers),
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
        )

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part; `total` is what the model holds (a tied LM head is the
        embedding table, so it is not counted twice)."""
        h, d = self.hidden, self.head_dim
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
        layers = self.layers * per_layer
        return {
            "embedding": embedding,
            "lm_head": lm_head,
            "per_layer": per_layer,
            "layers": layers,
            "final_norm": h,
            "total": embedding + lm_head + layers + h,
        }

    def streamed_parameters(self) -> int:
        """Parameters a decode step reads in full: all but the gathered embedding table,
        which with tied embeddings is read anyway, as the LM head."""
        counts = self.parameter_counts()
        if self.tie_word_embeddings:
            return counts["total"]
        return counts["total"] - counts["embedding"]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
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
