"""Tiny randomly initialised models of each supported architecture, saved with
transformers' own `save_pretrained`, for parity and loader tests."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Wider than the default init, so logits are peaked and greedy ties are rare.
    initializer_range=0.25,
    tie_word_embeddings=False,
)


def tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if arch == "llama3":
        cfg = LlamaConfig(
            **COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "mistral":
        cfg = MistralConfig(**COMMON, sliding_window=48, head_dim=16)
        cfg.architectures = ["MistralForCausalLM"]
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**COMMON, "num_key_value_heads": 1})
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=32)
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(arch)
    return cfg


def make_tiny_model(arch: str, folder: Path, seed: int = 0, **save_kwargs):
    """Builds the reference model, saves it to `folder`, returns it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    if arch == "qwen2":  # the default init zeroes biases; make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(folder, **save_kwargs)
    return model


ARCHS = ["llama3", "mistral", "qwen2", "qwen3"]


def tiny_engine_core(folder: Path, **extra):
    """An EngineCore on the CPU over a tiny model folder: float32, max_model_len 128, no
    tokenizer, 256 KV blocks; `extra` overrides any EngineArgs field."""
    from asyncllm.config import EngineArgs
    from asyncllm.engine.core import EngineCore
    from asyncllm.engine.core_config import create_engine_config

    args = dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        skip_tokenizer_init=True,
        num_gpu_blocks_override=256,
    )
    args.update(extra)
    return EngineCore(create_engine_config(EngineArgs(**args)))
