"""Pipeline parallelism end to end on the CPU, through the multiprocess executor: stages
of contiguous layers in worker processes (gloo over loopback, one torch thread each),
hidden states passed between them, up to `pipeline_parallel_size` steps in flight (the
core's batch queue), against the one-process executor (the TP=1 reference of
conftest.py). "Equal" follows DESIGN.md's tie rule where tensor-parallel sums come in.
"""

from __future__ import annotations

import os

import pytest

from asyncllm import LLM, EngineArgs, SamplingParams
from asyncllm.sampling_params import StructuredOutputsParams
from tests.distributed.engines import (
    GREEDY,
    PROMPTS,
    TINY,
    as_inputs,
    assert_equal_under_tie_rule,
    check_greedy_with_preemption_and_prefix_hits,
    check_seeded_sampling_and_logprobs,
    children,
    token_ids,
)


@pytest.fixture(scope="module")
def pp2_llama(tiny_models):
    """PP=2 over the llama3 model (one layer a stage), a KV cache of 16 blocks: the
    eight prompts (24 blocks at once) preempt each other."""
    llm = LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        pipeline_parallel_size=2,
        num_gpu_blocks_override=16,
        **TINY,
    )
    yield llm
    llm.shutdown()


def _core(llm: LLM):
    return llm.engine.client.core


def test_pp2_greedy_equals_tp1_with_preemption_and_prefix_hits(pp2_llama, reference):
    _, ref = reference
    core = _core(pp2_llama)
    assert len(core.executor.worker_pids) == 2 and core._depth == 2
    # (no sum is split across ranks: the tokens are exactly TP=1's)
    check_greedy_with_preemption_and_prefix_hits(pp2_llama, ref["llama3"], "PP=2", exact=True)


def test_pp2_seeded_sampling_and_logprobs_equal_tp1(pp2_llama, reference):
    check_seeded_sampling_and_logprobs(reference[0], pp2_llama)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "gemma3"])
def test_tp2_by_pp2_equals_tp1(tiny_models, reference, arch):
    """Four workers (two stages of two shards) on two CPUs; qwen2's one KV head is
    replicated on both shards of each stage; gemma3's windowed layer and global layer
    (two KV cache groups, prompts past the window) sit on different stages. Without
    async scheduling on qwen2."""
    _, ref = reference
    with LLM(
        str(tiny_models[arch]),
        multiprocess=False,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        num_gpu_blocks_override=64,
        async_scheduling=arch == "llama3",
        **TINY,
    ) as llm:
        assert len(_core(llm).executor.worker_pids) == 4
        outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert_equal_under_tie_rule(ref[arch], outs, f"{arch} TP=2 x PP=2")


def test_pp2_smollm_with_an_uneven_split_and_a_structured_output(llm, smollm_prompts, monkeypatch):
    """SmolLM2's 30 layers split 20 + 10 (ASYNCLLM_PP_LAYER_PARTITION), a few prompts
    and a request constrained by a choice (its bitmask goes with the step to the last
    stage, which samples)."""
    prompts = as_inputs(smollm_prompts[1:4])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    choice = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
    )
    want = llm.generate(prompts, greedy, use_tqdm=False)
    want_choice = llm.generate(prompts[:1], choice, use_tqdm=False)
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "20,10")
    with LLM(
        multiprocess=False,
        device="cpu",
        pipeline_parallel_size=2,
        max_model_len=512,
        num_gpu_blocks_override=32,
        cpu_threads=1,
    ) as pp2:
        got = pp2.generate(prompts, greedy, use_tqdm=False)
        got_choice = pp2.generate(prompts[:1], choice, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert got_choice[0].outputs[0].text == want_choice[0].outputs[0].text
    assert got_choice[0].outputs[0].text in ("Paris", "London", "Rome")


def test_a_pipeline_the_model_cannot_fill_is_refused_before_any_worker_starts(
    tiny_models, monkeypatch
):
    from asyncllm.engine.core_config import create_engine_config

    before = set(children(os.getpid()))
    path = str(tiny_models["llama3"])
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 cannot split .*2 layers"):
        create_engine_config(EngineArgs(path, pipeline_parallel_size=3, **TINY))
    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "2,1")
    with pytest.raises(ValueError, match=r"ASYNCLLM_PP_LAYER_PARTITION='2,1' sums to 3 layers"):
        create_engine_config(EngineArgs(path, pipeline_parallel_size=2, **TINY))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 needs 2 ranks"):
        EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert set(children(os.getpid())) <= before
