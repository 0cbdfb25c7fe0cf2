"""LLM and AsyncLLM share one frontend: the same errors, the same chat rules and the same
stats for the same causes. A model-free executor keeps these fast."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import AsyncLLM, EngineOverloadedError, SamplingParams
from asyncllm.frontend.frontend import request_exception
from asyncllm.messages import ErrorKind, RequestError

INSTANT = dict(
    device="cpu",
    max_model_len=1024,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)
LONG = SamplingParams(max_tokens=500, ignore_eos=True)


def _llm(**kw):
    from asyncllm import LLM

    return LLM(multiprocess=False, **{**INSTANT, **kw})


def test_llm_refuses_overload_with_engine_overloaded_error():
    with _llm(max_num_seqs=1, max_waiting_requests=1) as llm:
        # All five are queued before the first step: the second one already finds the
        # waiting queue full.
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            llm.generate([f"request {i}" for i in range(5)], LONG, use_tqdm=False)
        # The engine serves on, and nothing of the refused batch is left behind.
        assert not llm.engine.has_unfinished_requests()
        out = llm.generate("still here", SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


async def test_async_llm_refuses_overload_with_the_same_error():
    async with AsyncLLM(**INSTANT, max_num_seqs=1, max_waiting_requests=1) as llm:

        async def run(i):
            async for _ in llm.generate(f"request {i}", LONG):
                pass

        results = await asyncio.gather(*[run(i) for i in range(5)], return_exceptions=True)
        refused = [r for r in results if isinstance(r, EngineOverloadedError)]
        assert refused and all("max_waiting_requests" in str(r) for r in refused)
        assert all(r is None or isinstance(r, EngineOverloadedError) for r in results)


def test_llm_chat_needs_the_tokenizer():
    with _llm(skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}])


async def test_async_llm_chat_needs_the_tokenizer():
    async with AsyncLLM(**INSTANT, skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="tokenizer"):
            async for _ in llm.chat([{"role": "user", "content": "hi"}]):
                pass
        # token-id prompts still work without a tokenizer
        outs = [o async for o in llm.generate([1, 2, 3], SamplingParams(max_tokens=2))]
        assert outs[-1].outputs[0].token_ids and outs[-1].outputs[0].text == ""


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "user"}, "x"], None])
def test_bad_conversations_are_type_errors(messages):
    with _llm() as llm:
        with pytest.raises(TypeError, match="messages"):
            llm.chat(messages)


async def test_both_entry_points_report_the_same_stats():
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _llm() as llm:
        llm.generate(["a", "b"], params, use_tqdm=False)
        sync_stats = llm.get_stats()
    async with AsyncLLM(**INSTANT) as allm:
        for prompt in ("a", "b"):
            async for _ in allm.generate(prompt, params):
                pass
        async_stats = await allm.get_stats()
    assert sync_stats.keys() == async_stats.keys()
    for stats in (sync_stats, async_stats):
        assert stats["e2e_latency_s"]["count"] == 2 and stats["ttft_s"]["count"] == 2
        assert stats["total_decode_tokens"] + stats["total_prefill_tokens"] > 0
        assert stats["num_frontend_requests"] == 0


@pytest.mark.parametrize(
    "kind,cls",
    [
        (ErrorKind.OVERLOADED, EngineOverloadedError),
        (ErrorKind.INVALID, ValueError),
        (ErrorKind.FAILED, RuntimeError),
    ],
)
def test_error_kinds_map_to_exceptions(kind, cls):
    err = request_exception("r7", RequestError(kind, "why"))
    assert isinstance(err, cls) and "r7" in str(err) and "why" in str(err)


def test_a_prefill_threshold_without_chunked_prefill_never_stalls_a_long_prompt():
    # The threshold caps a prefill chunk; with chunking off a prompt cannot be split, so
    # the cap must not apply (it used to leave such a prompt waiting forever).
    with _llm(enable_chunked_prefill=False, long_prefill_token_threshold=4) as llm:
        out = llm.generate([list(range(1, 40))], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
