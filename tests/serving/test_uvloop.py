"""AsyncLLM under uvloop's event loop."""

from __future__ import annotations

import asyncio

from asyncllm import AsyncLLM, SamplingParams


def test_works_under_uvloop():
    import uvloop  # a test dependency: its absence is a failure, not a skip

    async def main():
        async with AsyncLLM(device="cpu", max_model_len=256, kv_cache_memory_bytes=64 << 20) as llm:
            outs = [
                o async for o in llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))
            ]
            return outs[-1].outputs[0].token_ids

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert len(runner.run(main())) == 3
