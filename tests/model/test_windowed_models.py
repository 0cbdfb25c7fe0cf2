"""Models with windowed layers through the whole engine: Gemma 2 and Gemma 3 (text),
Qwen2 with a window from `max_window_layers` on, and Mistral (every layer windowed); prompts longer than the sliding window,
chunked prefill, the prefix cache (the same prompts twice: the hits span the windowed
groups) and preemption (a KV cache too small for the batch), against transformers'
greedy output under DESIGN.md's tie rule. The windowed layers free their old blocks
(the hybrid KV cache: model/kv_groups.py)."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from tests.model.helpers import assert_greedy_parity
from tests.model.tiny import make_tiny_model

PROMPT_LENS = [5, 47, 60, 130, 170, 220]  # the window is 48 tokens


@pytest.mark.parametrize(
    "arch,device,caching",
    [
        ("gemma2", "cpu", True),
        ("gemma3", "cpu", True),
        ("gemma3", "cpu", False),
        ("qwen2-window", "cpu", True),
        ("mistral", "cpu", True),  # (every layer windowed: one group)
        ("gemma3-mm", "cpu", True),  # (the text model of the multimodal checkpoint)
        # (the Triton kernels, soft cap and window included, and the decode graphs)
        pytest.param("gemma2", "cuda", True, marks=pytest.mark.gpu),
        pytest.param("gemma3", "cuda", True, marks=pytest.mark.gpu),
    ],
)
def test_windowed_models_through_the_engine_equal_transformers(arch, device, caching, tmp_path):
    ref = make_tiny_model(arch, tmp_path / arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    blocks = 20 if arch == "mistral" else 40  # (windowed layers alone hold few blocks)
    with LLM(
        str(tmp_path / arch),
        multiprocess=False,
        device=device,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=64,  # chunked prefill
        num_gpu_blocks_override=blocks,  # the batch needs more: preemption
        enable_prefix_caching=caching,
        cpu_threads=1 if device == "cpu" else None,
        gpu_memory_utilization=0.2,
    ) as llm:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        first = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]
        # (the longest first: their blocks were freed last, so they are still cached)
        again = llm.generate(inputs[:3:-1], params, use_tqdm=False)
        stats = llm.get_stats()
        worker = llm.engine.client.core.executor.worker
        runner = worker.runner
        windows = [
            layer.self_attn.spec.sliding_window for layer in runner.loaded_model().model.layers
        ]
    assert stats["num_preemptions"] > 0 and (stats["prefix_cache_hits"] > 0) == caching, stats
    assert all((o.num_cached_tokens > 0) == caching for o in again)
    # Two KV cache groups (a full-attention layer, a windowed one; Mistral: both
    # windowed, one group), every block back.
    assert stats["num_held_blocks_per_group"] == [0] * (1 if arch == "mistral" else 2)
    assert stats["num_free_blocks"] == stats["num_blocks"] == blocks - 1  # (the null block)
    # A request of max_model_len (256) holds 16 blocks in a full-attention group and
    # ceil(48 / 16) + 1 in a windowed one: start-up's "max concurrency" counts so.
    assert worker.report.max_concurrency == (blocks - 1) / (4 if arch == "mistral" else 16 + 4)
    assert [list(o.outputs[0].token_ids) for o in again] == first[:3:-1]
    assert_greedy_parity(ref, prompts, first, arch)  # (transformers on the CPU)
    if arch == "qwen2-window":  # max_window_layers=1: the first layer is global
        assert windows == [None, 48]
