"""DeepSeek-V2 (latent attention and experts with shared ones) through the engine: tiny
random models against transformers' greedy output, with chunked prefill (steps mixing
decodes, which take the absorbed path, with prefill chunks, which take the up-projected
one), preemption, the prefix cache on and off; the latent cache's size; the routing;
and what is refused."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_engine_config
from asyncllm.model.attention.mla import MLABackend
from asyncllm.model.interface import KVCacheSpec
from asyncllm.model.layers.fused_moe import FusedMoE, select_experts_grouped
from tests.model.helpers import assert_greedy_parity
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="module", params=["deepseek-v2", "deepseek-v2-lora"])
def deepseek(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_tiny_model(request.param, folder)


def _llm(folder, **extra) -> LLM:
    args = dict(
        multiprocess=False,
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=192,
        max_num_batched_tokens=64,  # chunked prefill: decodes beside prefill chunks
        num_gpu_blocks_override=13,  # preemption
        cpu_threads=1,
    )
    args.update(extra)
    return LLM(str(folder), **args)


def test_deepseek_v2_through_the_engine_equals_transformers(deepseek):
    arch, folder, ref = deepseek
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (2, 37, 90, 150)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # The prefix cache on (a second run of the longest prompt hits it) for one variant,
    # off for the other: both ways over the same paths.
    caching = arch == "deepseek-v2"
    with _llm(folder, enable_prefix_caching=caching) as llm:
        first = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]
        again = llm.generate(inputs[-1:], params, use_tqdm=False)
        stats = llm.get_stats()
        runner = llm.engine.client.core.executor.worker.runner
        model = runner.loaded_model()
        cache_shape = tuple(runner.kv_caches[0].shape)
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats  # every block back
    assert (again[0].num_cached_tokens > 0) == caching
    assert list(again[0].outputs[0].token_ids) == first[-1]
    assert_greedy_parity(ref, prompts, first, arch)
    # One latent vector (32 + 8 values) per token and layer: a quarter of what K and V
    # of 4 heads of 24 would take.
    assert isinstance(runner.backend, MLABackend) and runner.backend.name == "torch_mla"
    assert model.kv_cache_spec() == KVCacheSpec(2, 1, 40, latent=True)
    assert cache_shape == (13, 16, 40)
    # Layer 0 dense, layer 1 with experts loaded from per-expert tensors.
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE) and not hasattr(model.model.layers[0].mlp, "experts")
    hf = ref.model.layers[1].mlp
    assert torch.equal(experts.w13_weight, hf.experts.gate_up_proj)
    assert torch.equal(model.model.layers[1].mlp.gate.weight, hf.gate.weight)


def test_long_contexts_are_attended_in_chunks_merged_by_log_sum_exp(tmp_path, monkeypatch):
    """Past CONTEXT_CHUNK tokens a prefill chunk's keys are up-projected a chunk at a
    time (here 40 tokens, and score blocks of a few queries): the same output."""
    from asyncllm.model.attention import mla

    arch, folder = "deepseek-v2-lora", tmp_path / "deepseek-lora"
    ref = make_tiny_model(arch, folder)
    monkeypatch.setattr(mla, "CONTEXT_CHUNK", 40)
    monkeypatch.setattr(mla, "SCORE_ELEMENTS", 4 * 40 * 5)  # 5 queries at a time
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (100, 150)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with _llm(folder, num_gpu_blocks_override=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_parity(ref, prompts, [list(o.outputs[0].token_ids) for o in outs], arch)


def test_group_limited_routing_keeps_the_best_groups_and_scales():
    # 4 experts in 2 groups; the first group's best (0.5) beats the second's (0.3), so
    # with one group kept the top-2 come from experts 0 and 1 only.
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    w, ids = select_experts_grouped(logits, 2, num_groups=2, topk_groups=1, scaling=2.0)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(w, torch.tensor([[1.0, 0.1]]))
    w, ids = select_experts_grouped(logits, 2, num_groups=None, topk_groups=None, scaling=1.0)
    assert ids.tolist() == [[0, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.3]]))


def test_what_is_refused(tmp_path):
    folder = tmp_path / "deepseek"
    make_tiny_model("deepseek-v2", folder)
    with pytest.raises(ValueError, match="uses latent attention \\(MLA\\), which runs on one GPU"):
        create_engine_config(EngineArgs(str(folder), device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="uses latent attention \\(MLA\\), which runs on one GPU"):
        create_engine_config(EngineArgs(str(folder), device="cpu", pipeline_parallel_size=2))
    with pytest.raises(
        ValueError, match="attention_backend 'torch_native' does not support latent attention"
    ):
        create_engine_config(
            EngineArgs(str(folder), device="cpu", attention_backend="torch_native")
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deepseek_v2_on_cuda_through_the_triton_mla_backend_and_graphs(deepseek):
    """float32 on the GPU: the MLA decode kernel (inside the decode graphs), the latent
    cache write and the fused MoE kernel give transformers' greedy output."""
    arch, folder, ref = deepseek
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (2, 37, 90, 150)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with _llm(folder, device="cuda", cpu_threads=None, num_gpu_blocks_override=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.engine.client.core.executor.worker.runner
        assert runner.backend.name == "triton_mla" and runner.graphs is not None
    assert_greedy_parity(ref, prompts, [list(o.outputs[0].token_ids) for o in outs], arch)
