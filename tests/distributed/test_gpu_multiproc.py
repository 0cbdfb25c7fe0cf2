"""The multiprocess executor on one GPU: one worker process in an NCCL world of one,
CUDA graphs on, gives the in-process executor's greedy tokens, bit for bit (the same
kernels on the same device: nothing is split)."""

from __future__ import annotations

import pytest

from asyncllm import LLM, SamplingParams
from tests.distributed.engines import make_prompts
from tests.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

ENGINE = dict(
    device="cuda",
    dtype="bfloat16",
    max_model_len=128,
    skip_tokenizer_init=True,
    multiprocess=False,
    gpu_memory_utilization=0.2,
    cudagraph_capture_sizes=[1, 2, 4, 8, 16],
)


def test_mp_at_tp1_on_cuda_gives_the_in_process_tokens(tmp_path):
    make_tiny_model("llama3", tmp_path / "llama3")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(1) + make_prompts(2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "llama3"), **ENGINE) as uni:
        want = [o.outputs[0].token_ids for o in uni.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tmp_path / "llama3"), distributed_executor_backend="mp", **ENGINE) as mp:
        executor = mp.engine.client.core.executor
        assert type(executor).__name__ == "MultiprocExecutor"
        assert len(executor.worker_pids) == 1
        assert executor.startup_seconds().get("capture CUDA graphs", 0) > 0  # graphs on
        got = [o.outputs[0].token_ids for o in mp.generate(prompts, params, use_tqdm=False)]
    assert got == want
