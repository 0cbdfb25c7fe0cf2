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
    from transformers import (
        DeepseekV2Config,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

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
    elif arch == "qwen2-window":  # a window on the layers from max_window_layers on
        cfg = Qwen2Config(
            **{**COMMON, "num_key_value_heads": 1},
            use_sliding_window=True,
            sliding_window=48,
            max_window_layers=1,
        )
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        cfg = Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=32)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "qwen3-moe":  # 8 experts, 2 per token, renormalised; layer 1 dense
        cfg = Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif arch in ("deepseek-v2", "deepseek-v2-lora"):
        # MLA (a latent of 32 + a rotary key of 8; q through q_lora_rank in the -lora
        # variant, with YaRN and its mscale); layer 0 dense, then 8 routed experts, 3 per
        # token, in 4 groups of which 2 are kept, and 2 shared experts.
        lora = arch == "deepseek-v2-lora"
        cfg = DeepseekV2Config(
            **{**COMMON, "num_key_value_heads": 4},
            kv_lora_rank=32,
            q_lora_rank=24 if lora else None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            n_shared_experts=2,
            topk_method="group_limited_greedy" if lora else "greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=(
                {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                    "mscale": 0.707,
                    "mscale_all_dim": 0.707,
                    "beta_fast": 32,
                    "beta_slow": 1,
                }
                if lora
                else None
            ),
        )
        cfg.architectures = ["DeepseekV2ForCausalLM"]
    elif arch == "gemma2":  # a local then a global layer, both soft caps
        gemma = {**COMMON, "tie_word_embeddings": True, "head_dim": 16}
        cfg = Gemma2Config(**gemma, query_pre_attn_scalar=24, sliding_window=48)
        cfg.architectures = ["Gemma2ForCausalLM"]
    elif arch == "gemma3":  # q/k norm; RoPE by layer type, linear scaling on the global one
        gemma = {**COMMON, "tie_word_embeddings": True, "head_dim": 16}
        cfg = Gemma3TextConfig(
            **gemma,
            query_pre_attn_scalar=24,
            sliding_window=48,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif arch == "gemma3-mm":  # the multimodal checkpoint: gemma3's text model, a tiny tower
        from transformers import Gemma3Config, SiglipVisionConfig

        vision = SiglipVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        text = tiny_config("gemma3").to_dict()
        cfg = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4)
        cfg.architectures = ["Gemma3ForConditionalGeneration"]
    else:
        raise ValueError(arch)
    return cfg


def make_tiny_model(arch: str, folder: Path, seed: int = 0, **save_kwargs):
    """Builds the reference model, saves it to `folder`, returns it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if arch == "gemma3-mm":
        from transformers import Gemma3ForConditionalGeneration

        model = Gemma3ForConditionalGeneration(tiny_config(arch)).float()
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    if arch.startswith("qwen2"):  # the default init zeroes biases; make them count
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


ARCHS = ["llama3", "mistral", "qwen2", "qwen3", "qwen3-moe", "gemma2", "gemma3"]
# (qwen2-window, Qwen2 with a window from max_window_layers on, and gemma3-mm, Gemma 3's
# multimodal checkpoint run as a text model, run through the engine in
# tests/model/test_windowed_models.py)


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
