"""The benchmark workloads and the decode-floor arithmetic (no engine)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from asyncllm.bench.common import (
    DEFAULT_WORKLOAD_OUTPUT_TOKENS,
    format_table,
    make_fixed_workload,
    make_workload,
    percentile,
)
from asyncllm.bench.latency import latency_prompt
from asyncllm.bench.roofline import ModelShape, decode_floor

ROOT = Path(__file__).resolve().parents[2]

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def test_the_default_workload_is_nano_vllms():
    prompts, max_tokens = make_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert sum(max_tokens) == DEFAULT_WORKLOAD_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts)
    assert all(100 <= m <= 1024 for m in max_tokens)
    assert all(0 <= t <= 10000 for p in prompts for t in p)
    # Draw for draw what nano-vllm's bench.py does with the global generator.
    random.seed(0)
    ref = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    assert prompts == ref
    assert max_tokens == [random.randint(100, 1024) for _ in range(256)]


def test_a_scaled_workload_keeps_its_bounds():
    prompts, max_tokens = make_workload(num_prompts=20, max_input_len=64, max_output_len=32)
    assert len(prompts) == 20
    assert all(6 <= len(p) <= 64 for p in prompts)  # 100/1024 of the maximum
    assert all(3 <= m <= 32 for m in max_tokens)
    prompts, max_tokens = make_workload(4, max_input_len=8, min_input_len=8, min_output_len=5)
    assert {len(p) for p in prompts} == {8} and all(5 <= m <= 1024 for m in max_tokens)


def test_the_fixed_workloads():
    prompts, max_tokens, temperature = make_fixed_workload("prefill")
    assert len(prompts) == 256 and {len(p) for p in prompts} == {3000}
    assert set(max_tokens) == {16} and temperature == 0.0
    assert len({tuple(p) for p in prompts}) == 256
    prompts, max_tokens, temperature = make_fixed_workload("shared-prefix")
    assert len(prompts) == 512 and {len(p) for p in prompts} == {2048 + 64}
    assert set(max_tokens) == {64} and temperature == 0.0
    assert len({tuple(p[:2048]) for p in prompts}) == 1  # one prefix
    assert len({tuple(p[2048:]) for p in prompts}) == 512  # tails of their own
    small = make_fixed_workload("shared-prefix", 3, 10, 2, seed=1)
    assert [len(p) for p in small[0]] == [74] * 3 and small[1] == [2] * 3
    assert small == make_fixed_workload("shared-prefix", 3, 10, 2, seed=1)  # seeded
    with pytest.raises(ValueError, match="unknown workload 'decode'"):
        make_fixed_workload("decode")


def test_the_latency_prompt():
    p = latency_prompt()
    assert len(p) == 128 and all(0 <= t <= 10000 for t in p) and p == latency_prompt()
    rng = random.Random(1)
    assert p == [rng.randint(0, 10000) for _ in range(128)]


def tiny_hf_configs():
    from transformers import (
        DeepseekV2Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    deepseek = dict(
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        n_shared_experts=2,
    )

    return {
        "llama": LlamaConfig(**TINY),
        "llama_biases": LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
        "mistral": MistralConfig(**TINY, head_dim=16),
        "qwen2": Qwen2Config(**TINY),  # q/k/v biases
        "qwen3_tied": Qwen3Config(**{**TINY, "tie_word_embeddings": True}, head_dim=32),
        "qwen3": Qwen3Config(**{**TINY, "tie_word_embeddings": False}, head_dim=32),
        # 8 experts of 2 per token on layer 0, layer 1 dense
        "qwen3_moe": Qwen3MoeConfig(
            **TINY,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            mlp_only_layers=[1],
        ),
        # latent attention, layer 0 dense, layer 1 with 8 experts and 2 shared
        "deepseek_v2": DeepseekV2Config(**TINY, **deepseek, q_lora_rank=None),
        "deepseek_v2_q_lora": DeepseekV2Config(**TINY, **deepseek, q_lora_rank=24),
    }


@pytest.mark.parametrize("name", list(tiny_hf_configs()))
def test_parameter_count_matches_transformers(name):
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_configs()[name]
    model = AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.from_hf_config(cfg)
    assert shape.parameter_counts()["total"] == sum(p.numel() for p in model.parameters())
    # From the config.json dict too.
    assert ModelShape.from_hf_config(cfg.to_dict()) == shape


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"])
def test_parameter_count_matches_our_loader(tmp_path, arch, monkeypatch):
    monkeypatch.setenv(
        "ASYNCLLM_CPU_PACKING", "0"
    )  # (packed layers give up their parameters' storage)
    from asyncllm.config import EngineArgs
    from asyncllm.engine.core_config import create_model_config
    from asyncllm.model.attention.torch_native import TorchNativeBackend
    from asyncllm.model.loader import load_model

    model_type = arch.removesuffix("ForCausalLM").lower()
    cfg = {**TINY, "architectures": [arch], "model_type": model_type, "head_dim": 32}
    cfg["tie_word_embeddings"] = arch.startswith("Qwen3")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = create_model_config(EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu"))
    model = load_model(mc, TorchNativeBackend())
    # A tied LM head shares the embedding's tensor; parameters() yields it once.
    assert ModelShape.from_hf_config(mc.hf_config).parameter_counts()["total"] == sum(
        p.numel() for p in model.parameters()
    )


def test_the_decode_floor():
    cfgs = tiny_hf_configs()
    tied, untied = (ModelShape.from_hf_config(cfgs[n]) for n in ("qwen3_tied", "qwen3"))
    # Tied: the LM head reads the embedding table, so every parameter is streamed once.
    assert tied.streamed_parameters() == tied.parameter_counts()["total"]
    # Untied: the embedding table is gathered, not streamed.
    counts = untied.parameter_counts()
    assert untied.streamed_parameters() == counts["total"] - 384 * 64
    floor = decode_floor(untied, 2, input_len=128, output_len=512, bandwidth=1e9)
    kv = (128 + 256) * 2 * 2 * 2 * 32 * 2  # tokens x layers x (k, v) x kv heads x head_dim x bytes
    weights = untied.streamed_parameters() * 2
    assert floor["kv_bytes"] == kv and floor["weight_bytes"] == weights
    assert floor["floor_tok_s"] == pytest.approx(1e9 / (kv + weights))


def test_a_decode_step_reads_only_the_experts_it_routes_to():
    moe = ModelShape.from_hf_config(tiny_hf_configs()["qwen3_moe"])
    assert (moe.num_experts, moe.experts_per_token, moe.sparse_layers) == (8, 2, 1)
    expert = 3 * 64 * 24
    held = moe.parameter_counts()["total"] - 384 * 64  # (the untied embedding: gathered)
    assert moe.streamed_parameters() == held - 6 * expert  # batch 1: 2 of 8 experts
    assert moe.active_experts(1) == 2 and moe.active_experts(4) == pytest.approx(8 * (1 - 0.75**4))
    assert moe.streamed_parameters(10_000) == pytest.approx(held, abs=1)  # all of them


def test_a_latent_cache_holds_one_vector_per_token_and_layer():
    mla = ModelShape.from_hf_config(tiny_hf_configs()["deepseek_v2"])
    assert mla.kv_bytes_per_token(2) == 2 * (32 + 8) * 2  # layers x (latent + rope) x bytes
    assert mla.sparse_layers == 1  # (first_k_dense_replace=1 of 2 layers)
    held = mla.parameter_counts()["total"] - 384 * 64
    expert = 3 * 64 * 24
    assert mla.streamed_parameters() == held - 6 * expert  # the shared experts are read


def test_the_shipped_configs():
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(ROOT / "benchmarks/configs/qwen3-0.6b")
    llama = AutoConfig.from_pretrained(ROOT / "benchmarks/configs/llama-3.1-8b")
    assert qwen.architectures == ["Qwen3ForCausalLM"] and qwen.tie_word_embeddings
    assert llama.architectures == ["LlamaForCausalLM"] and not llama.tie_word_embeddings
    # The published sizes: Qwen3-0.6B has 0.44B parameters outside the embedding table.
    q = ModelShape.from_hf_config(qwen).parameter_counts()
    assert q["total"] == 596_049_920 and q["total"] - q["embedding"] == 440_467_456
    assert ModelShape.from_hf_config(llama).parameter_counts()["total"] == 8_030_261_248
    floor = decode_floor(ModelShape.from_hf_config(qwen), 2, 128, 512)
    assert 3000 < floor["floor_tok_s"] < 4000  # ~1.24 GB a step at 4.3 TB/s
    # DeepSeek-V2-Lite's published sizes: 15.7B parameters, 2.4B active per token.
    lite = ModelShape.from_hf_config(
        AutoConfig.from_pretrained(ROOT / "benchmarks/configs/deepseek-v2-lite")
    )
    assert lite.parameter_counts()["total"] == 15_706_484_224
    assert round(lite.streamed_parameters() / 1e9, 2) == 2.45  # read by a batch-1 step
    assert lite.kv_bytes_per_token(2) == 27 * 576 * 2


def test_report_helpers():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert torch.isnan(torch.tensor(percentile([], 50)))
    text = format_table(["a", "b"], [["x", 1.5], ["y", float("nan")]])
    assert text.splitlines()[2].split() == ["x", "1.50"] and text.splitlines()[3].split() == [
        "y",
        "-",
    ]
