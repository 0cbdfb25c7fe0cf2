"""AsyncLLM under asyncio and under trio: streams, cancellation by a cancel scope, and
the engine core's death, the same test bodies under both (written on anyio, so one body
serves both libraries). Each test runs its body with `anyio.run(..., backend=...)`
itself: with pytest-asyncio in auto mode an async test under anyio's plugin would be
run by pytest-asyncio on asyncio, so these tests are plain functions."""

from __future__ import annotations

import os
import signal

import pytest

from asyncllm import AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams

anyio = pytest.importorskip("anyio")
sniffio = pytest.importorskip("sniffio")
pytest.importorskip("trio")

BACKENDS = ["asyncio", "trio"]
INSTANT = dict(
    device="cpu",
    max_model_len=8192,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)


def run(body, backend: str):
    async def main():
        assert sniffio.current_async_library() == backend
        return await body()

    return anyio.run(main, backend=backend)


async def _idle(llm: AsyncLLM) -> bool:
    stats = await llm.get_stats()
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["num_free_blocks"] == stats["num_blocks"]
        and not llm.frontend.has_unfinished_requests()
    )


async def _wait_until_idle(llm: AsyncLLM) -> None:
    with anyio.fail_after(60):
        while not await _idle(llm):
            await anyio.sleep(0.02)  # (polls a condition; the deadline names the failure)


async def _streams() -> list[tuple[str, list[int]]]:
    """Three prompts streamed at once (DELTA), each collected."""
    params = SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA)
    results: dict[int, tuple[str, list[int]]] = {}
    async with AsyncLLM(**INSTANT) as llm:

        async def one(i: int, prompt: str) -> None:
            text, ids = "", []
            async for out in llm.generate(prompt, params):
                text += out.outputs[0].text
                ids += out.outputs[0].token_ids
            results[i] = (text, ids)

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(["Hello", "A longer prompt here", "Three"]):
                tg.start_soon(one, i, prompt)
        await _wait_until_idle(llm)
    return [results[i] for i in range(3)]


def test_streams_are_the_same_under_both_backends():
    by_backend = {b: run(_streams, b) for b in BACKENDS}
    assert by_backend["trio"] == by_backend["asyncio"]
    assert all(len(ids) == 12 and text for text, ids in by_backend["trio"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cancel_scope_aborts_the_request_and_engine_death_fails_the_streams(backend):
    async def body():
        params = SamplingParams(max_tokens=8000, output_kind=RequestOutputKind.DELTA)
        async with AsyncLLM(**INSTANT) as llm:
            got = 0
            with anyio.CancelScope() as scope:
                async for out in llm.generate("Go on and on", params):
                    got += len(out.outputs[0].token_ids)
                    scope.cancel()  # the next wait inside the stream is cancelled
            assert scope.cancelled_caught and 0 < got < 8000
            await _wait_until_idle(llm)  # aborted in the engine, its blocks back
            outs = [o async for o in llm.generate("again", SamplingParams(max_tokens=3))]
            assert len(outs[-1].outputs[0].token_ids) == 3  # the engine serves on

            # A stream that was left (aclose) leaves its outputs queued in the socket;
            # the next stream's consumer still runs between messages (under trio a
            # handler that never checkpointed starved it until the request had ended).
            for _ in range(4):
                stream = llm.generate("Go on", params)
                first = await stream.__anext__()
                assert not first.finished and len(first.outputs[0].token_ids) < 1000
                await stream.aclose()
            await _wait_until_idle(llm)

            stream = llm.generate("Go on", params)
            await stream.__anext__()
            os.kill(llm.engine_core_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                with anyio.fail_after(60):
                    async for _ in stream:
                        pass
            assert llm.errored
            with pytest.raises(EngineDeadError):
                await llm.generate("x", params).__anext__()

    run(body, backend)


def test_start_alone_under_trio_says_to_use_async_with():
    async def body():
        llm = AsyncLLM(**INSTANT)
        with pytest.raises(RuntimeError, match="async with AsyncLLM"):
            await llm.start()

    run(body, "trio")


def test_move_on_after_aborts_and_a_cancelled_block_shuts_down_under_trio():
    """trio.move_on_after around a stream aborts it in the core; 16 text prompts at once
    all finish; a block left in a cancelled scope still shuts the engine down."""
    import trio

    async def body():
        params = SamplingParams(max_tokens=8000, output_kind=RequestOutputKind.DELTA)
        with trio.move_on_after(1e9) as outer:
            async with AsyncLLM(**INSTANT) as llm:
                got = []
                with trio.move_on_after(0) as timed_out:
                    async for out in llm.generate("Run long", params):
                        got.append(out)
                assert timed_out.cancelled_caught and got == []
                await _wait_until_idle(llm)
                outs: dict[int, list] = {}

                async def one(i):
                    outs[i] = [
                        o async for o in llm.generate(f"prompt {i}", SamplingParams(max_tokens=2))
                    ]

                async with trio.open_nursery() as nursery:
                    for i in range(16):
                        nursery.start_soon(one, i)
                assert all(len(v[-1].outputs[0].token_ids) == 2 for v in outs.values())
                pid = llm.engine_core_pid
                outer.cancel()  # leaves the block in a cancelled scope: shutdown still runs
                await trio.lowlevel.checkpoint()  # (where the cancellation lands)
                raise AssertionError("the cancelled scope did not end the block")
        assert outer.cancelled_caught
        with trio.fail_after(60):
            while _alive(pid):
                await trio.sleep(0.02)  # (polls a condition; the deadline names the failure)

    run(body, "trio")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # (not our child: the kill above says it exists)
    return done == 0
