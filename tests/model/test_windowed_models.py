"""Models with windowed layers through the whole engine: Gemma 2 and Gemma 3 (text), and
Qwen2 with a window from `max_window_layers` on; prompts longer than the sliding window, chunked prefill, the prefix cache (the same prompts twice) and
preemption (a KV cache too small for the batch), against transformers' greedy output
under DESIGN.md's tie rule."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.model.helpers import assert_greedy_parity
from tests.model.tiny import make_tiny_model

PROMPT_LENS = [5, 47, 60, 130, 170, 220]  # the window is 48 tokens


@pytest.mark.parametrize(
    "arch,device",
    [
        ("gemma2", "cpu"),
        ("gemma3", "cpu"),
        ("qwen2-window", "cpu"),
        # (the Triton kernels, soft cap and window included, and the decode graphs)
        pytest.param("gemma2", "cuda", marks=pytest.mark.gpu),
        pytest.param("gemma3", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_windowed_models_through_the_engine_equal_transformers(arch, device, tmp_path):
    ref = make_tiny_model(arch, tmp_path / arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tmp_path / arch),
        multiprocess=False,
        device=device,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=64,  # chunked prefill
        num_gpu_blocks_override=40,  # the batch needs more: preemption
        cpu_threads=1 if device == "cpu" else None,
        gpu_memory_utilization=0.2,
    ) as llm:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        first = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]
        again = llm.generate(inputs[3:], params, use_tqdm=False)
        stats = llm.get_stats()
        model = llm.engine.client.core.executor.worker.runner.loaded_model()
        windows = [layer.self_attn.spec.sliding_window for layer in model.model.layers]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [list(o.outputs[0].token_ids) for o in again] == first[3:]
    assert_greedy_parity(ref, prompts, first, arch)  # (transformers on the CPU)
    if arch == "qwen2-window":  # max_window_layers=1: the first layer is global
        assert windows == [None, 48]
