"""LLM and AsyncLLM on a CUDA device, with a tiny random model and token-id prompts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncllm import LLM, AsyncLLM, SamplingParams
from tests.model.helpers import assert_greedy_parity
from tests.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gpu")
    ref = make_tiny_model("qwen3", folder)
    return folder, ref.cuda()


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (1, 9, 40, 130, 300)]


def _float32_llm(folder, **kwargs) -> LLM:
    return LLM(
        str(folder),
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=512,
        gpu_memory_utilization=0.3,
        **kwargs,
    )


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_greedy_on_cuda_equals_transformers(tiny_folder, multiprocess):
    folder, ref = tiny_folder
    prompts = _prompts()
    with _float32_llm(folder, multiprocess=multiprocess) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
        stats = llm.get_stats()
    assert_greedy_parity(ref, prompts, [o.outputs[0].token_ids for o in outs], "cuda")
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_async_llm_on_cuda(tiny_folder):
    folder, _ = tiny_folder

    async def main():
        async with AsyncLLM(
            str(folder),
            device="cuda",
            skip_tokenizer_init=True,
            max_model_len=512,
            gpu_memory_utilization=0.3,
        ) as llm:

            async def one(p):
                outs = [
                    o
                    async for o in llm.generate(
                        {"prompt_token_ids": p},
                        SamplingParams(max_tokens=16, ignore_eos=True, seed=1),
                    )
                ]
                return outs[-1].outputs[0].token_ids

            return await asyncio.gather(*[one(p) for p in _prompts()])

    results = asyncio.run(main())
    assert [len(r) for r in results] == [16] * 5


def test_prompt_logprobs_on_cuda_equal_transformers(tiny_folder):
    """Prompt logprobs, queued to pinned memory behind the step's event, equal the
    log-softmax of the reference model's logits: each prompt token's and the top 3."""
    folder, ref = tiny_folder
    prompts = _prompts()
    with _float32_llm(folder) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
            use_tqdm=False,
        )
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        with torch.no_grad():
            want = ref(torch.tensor([prompt], device="cuda")).logits[0].float().log_softmax(-1)
        for p in range(1, len(prompt)):
            got, row = out.prompt_logprobs[p], want[p - 1]
            assert abs(got[prompt[p]].logprob - row[prompt[p]].item()) <= 2e-3
            top = sorted((lp.logprob for lp in got.values()), reverse=True)[:3]
            assert torch.allclose(torch.tensor(top), row.topk(3).values.cpu(), atol=2e-3)
