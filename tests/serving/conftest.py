"""One AsyncLLM (an engine-core process with SmolLM2) shared by the serving tests,
on one session-wide event loop."""

from __future__ import annotations

import pytest_asyncio

from asyncllm import AsyncLLM

SERVING_ARGS = dict(device="cpu", max_model_len=1024, kv_cache_memory_bytes=512 << 20)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def allm():
    async with AsyncLLM(**SERVING_ARGS) as engine:
        yield engine
