"""examples/fastapi_sse.py on uvicorn in this loop (the model-free executor): a full
stream, then a client that leaves after its first event, whose request is aborted."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

INSTANT = dict(
    device="cpu",
    max_model_len=512,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_sse.py"


def _load():
    spec = importlib.util.spec_from_file_location("fastapi_sse_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _until(cond, what: str) -> None:
    async with asyncio.timeout(60):
        while not await cond():
            await asyncio.sleep(0.02)  # (polls a condition; the timeout names it)


async def _get(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def test_streams_tokens_and_aborts_when_the_client_leaves():
    app = _load().create_app(**INSTANT)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        assert not serving.done(), serving
        return server.started

    await _until(started, "the server to start")
    port = server.servers[0].sockets[0].getsockname()[1]
    llm = app.state.llm
    try:
        reader, writer = await _get(port, "/generate?prompt=Hello&max_tokens=5")
        body = (await reader.read()).decode()
        writer.close()
        events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["finish_reason"] == "length"
        text = "".join(c["text"] for c in chunks)
        assert len(llm.tokenizer(text, add_special_tokens=False).input_ids) >= 1

        reader, writer = await _get(port, "/generate?prompt=Go&max_tokens=400")
        await reader.readuntil(b"data: ")
        writer.close()  # the client leaves after the first event

        async def idle() -> bool:
            stats = await llm.get_stats()
            return stats["num_running"] == 0 and not llm.frontend.has_unfinished_requests()

        await _until(idle, "the abandoned request to be aborted")
        stats = await llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        server.should_exit = True
        await serving
