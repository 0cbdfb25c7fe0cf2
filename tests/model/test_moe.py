"""Qwen3-MoE through the engine: a tiny random model (8 experts, 2 per token,
renormalised; its second layer dense) against transformers' greedy output, with chunked
prefill, preemption and prefix hits; its experts' weights load into stacked tensors,
and tensor parallelism is refused before any worker starts."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.model.layers.fused_moe import FusedMoE, select_experts
from tests.model.helpers import assert_greedy_parity
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-moe")
    return folder, make_tiny_model("qwen3-moe", folder)


def test_qwen3_moe_through_the_engine_equals_transformers(moe_folder):
    folder, ref = moe_folder
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (3, 40, 90, 150)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(
        str(folder),
        multiprocess=False,
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=64,  # chunked prefill
        num_gpu_blocks_override=20,  # preemption
        cpu_threads=1,
    ) as llm:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        first = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]
        again = llm.generate(inputs[-1:], params, use_tqdm=False)
        stats = llm.get_stats()
        model = llm.engine.client.core.executor.worker.runner.loaded_model()
    assert stats["num_preemptions"] > 0 and again[0].num_cached_tokens > 0, stats
    assert list(again[0].outputs[0].token_ids) == first[-1]
    assert_greedy_parity(ref, prompts, first, "qwen3-moe")
    # Layer 0 has experts (loaded from the checkpoint's per-expert tensors), layer 1 not.
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and not hasattr(model.model.layers[1].mlp, "experts")
    hf = ref.model.layers[0].mlp.experts  # (transformers 5 stacks them too)
    assert torch.equal(experts.w13_weight, hf.gate_up_proj) and torch.equal(
        experts.w2_weight, hf.down_proj
    )


def test_tensor_parallelism_is_refused_before_any_worker_starts(moe_folder):
    from asyncllm.config import EngineArgs
    from asyncllm.engine.core_config import create_engine_config

    folder, _ = moe_folder
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=2 cannot shard Qwen3MoeForCausalLM: its mixture-of-experts",
    ):
        create_engine_config(EngineArgs(str(folder), device="cpu", tensor_parallel_size=2))


def test_routing_and_bad_expert_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights.sum(-1), torch.ones(1))
    raw, _ = select_experts(logits, 2, renormalize=False)
    assert torch.allclose(raw, torch.softmax(logits, -1)[:, :2])
    # Rounded through a half type (the activations'); a wider type leaves them as they are
    half, _ = select_experts(logits, 2, renormalize=False, round_to=torch.bfloat16)
    assert half.dtype == torch.float32 and torch.equal(half, raw.to(torch.bfloat16).float())
    assert not torch.equal(half, raw)
    wide, _ = select_experts(logits, 2, renormalize=False, round_to=torch.float64)
    assert wide.dtype == torch.float32 and torch.equal(wide, raw)
    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
    with pytest.raises(ValueError, match="expert 4 out of range"):
        moe.load_expert(4, "gate_proj", torch.zeros(6, 8))
    with pytest.raises(ValueError, match=r"expert 1 up_proj has shape \(8, 6\), expected \(6, 8\)"):
        moe.load_expert(1, "up_proj", torch.zeros(8, 6))
    with pytest.raises(ValueError, match="unknown expert projection 'w3'"):
        moe.load_expert(1, "w3", torch.zeros(6, 8))
    with pytest.raises(ValueError, match="top_k must be in"):
        FusedMoE(num_experts=4, top_k=5, hidden_size=8, intermediate_size=6, renormalize=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_routing_inside_the_gemm_gives_the_layer_its_routing_kernel_gives(monkeypatch, tokens):
    """ASYNCLLM_MOE_ROUTED=1 (up to 4 tokens, the gate/up programs route their tokens;
    past it the routing kernel runs) against the default path, Qwen3-30B-A3B's routing
    (128 experts, 8 per token, renormalised, weights rounded to bf16)."""
    torch.manual_seed(tokens)
    layers = {}
    for routed in ("0", "1"):
        monkeypatch.setenv("ASYNCLLM_MOE_ROUTED", routed)
        layers[routed] = FusedMoE(128, 8, 256, 64, renormalize=True).cuda().bfloat16()
    assert layers["1"].route_in_gemm and not layers["0"].route_in_gemm
    with torch.no_grad():
        for w in ("w13_weight", "w2_weight"):
            getattr(layers["0"], w).normal_(std=0.05)
            getattr(layers["1"], w).copy_(getattr(layers["0"], w))
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, 128, device="cuda", dtype=torch.bfloat16)
    want, got = layers["0"](x, logits).float(), layers["1"](x, logits).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
