"""AsyncLLM when things go wrong: a killed core, a killed host, bad models, overload."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncllm import (
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    EngineOverloadedError,
    EngineStartupError,
    SamplingParams,
)
from tests.conftest import ROOT
from tests.serving.conftest import SERVING_ARGS, LoopTicker

pytestmark = pytest.mark.asyncio(loop_scope="session")
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'kernels'}", "OMP_NUM_THREADS": "1"}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_kill_9_of_the_core_fails_every_stream_promptly():
    llm = await AsyncLLM(**SERVING_ARGS).start()
    pid = llm.engine_core_pid
    params = SamplingParams(max_tokens=5000, ignore_eos=True, temperature=0.0)
    started = asyncio.Event()

    async def stream(i):
        async for _ in llm.generate(f"Stream {i}: tell a long story", params):
            started.set()

    tasks = [asyncio.create_task(stream(i)) for i in range(10)]
    await asyncio.wait_for(started.wait(), 30)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert time.monotonic() - t0 < 5
    assert llm.errored and not llm.is_running
    t1 = time.monotonic()
    with pytest.raises(EngineDeadError):
        async for _ in llm.generate("again?", params):
            pass
    assert time.monotonic() - t1 < 0.5
    await llm.shutdown()
    assert not _pid_alive(pid)


SCRIPT_HOLD = textwrap.dedent(
    """
    import asyncio, sys
    from asyncllm import AsyncLLM, SamplingParams

    async def main():
        llm = await AsyncLLM(device="cpu", max_model_len=256, kv_cache_memory_bytes=64 << 20).start()
        print(llm.engine_core_pid, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)

SCRIPT_NO_GUARD = textwrap.dedent(
    """
    import asyncio
    from asyncllm import AsyncLLM, SamplingParams

    async def main():
        async with AsyncLLM(device="cpu", max_model_len=256, kv_cache_memory_bytes=64 << 20) as llm:
            async for out in llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0.0)):
                pass
            print("OK", len(out.outputs[0].token_ids), flush=True)

    asyncio.run(main())
    """
)


async def test_a_killed_host_leaves_no_engine_core_behind(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(SCRIPT_HOLD)
    child = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=ENV, text=True
    )
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 120)
    core_pid = int(line.strip())
    assert _pid_alive(core_pid)
    child.kill()
    child.wait()
    deadline = time.monotonic() + 5
    while _pid_alive(core_pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not _pid_alive(core_pid), "the engine core outlived its host"


async def test_a_script_without_a_main_guard_runs(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT_NO_GUARD)
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK 3" in proc.stdout


async def test_a_bad_model_path_fails_fast_with_its_name():
    llm = AsyncLLM(model="/no/such/model", device="cpu")
    with pytest.raises(EngineStartupError, match="no/such/model") as info:
        await llm.start()
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert llm.client is None  # found on the host side: no core process was started


async def test_a_core_that_cannot_start_reports_why():
    with pytest.raises(EngineStartupError, match="max_model_len"):
        await AsyncLLM(device="cpu", max_model_len=1024, num_gpu_blocks_override=4).start()


async def test_overload_refuses_the_fifth_waiting_request_and_the_others_finish():
    async with LoopTicker() as ticker:
        llm = AsyncLLM(**{**SERVING_ARGS, "max_num_seqs": 1, "max_waiting_requests": 4})
        await llm.start()  # the ticker keeps running while the model loads
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)

            async def run(i, p=params):
                outs = [o async for o in llm.generate(f"Request {i}", p, request_id=f"r{i}")]
                return outs[-1].outputs[0].token_ids

            async def until(field, value):
                while (await llm.get_stats())[field] != value:
                    await asyncio.sleep(0.01)

            # Request 0 runs until it is aborted below, so the next four wait behind it.
            first = asyncio.create_task(run(0, params.clone(max_tokens=900)))
            await until("num_running", 1)
            waiting = [asyncio.create_task(run(i)) for i in range(1, 5)]
            await until("num_waiting", 4)
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
                await run(5)
            await llm.abort("r0")  # the four waiting ones then run
            results = await asyncio.gather(first, *waiting)
            assert len(results[0]) < 900 and [len(r) for r in results[1:]] == [5, 5, 5, 5]
        finally:
            await llm.shutdown()
    assert ticker.worst_gap < 1.0, (
        f"the loop stalled {ticker.worst_gap:.2f} s during startup or serving"
    )


async def _engine_failing_on_its_third_step() -> AsyncLLM:
    llm = AsyncLLM.from_engine_args(
        EngineArgs(
            device="cpu",
            max_model_len=256,
            distributed_executor_backend="tests.serving.failing_executor:FailOnThirdStep",
        )
    )
    return await llm.start()


async def test_an_exception_in_the_core_reaches_every_stream_with_its_reason():
    llm = await _engine_failing_on_its_third_step()
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def stream(i):
        async for _ in llm.generate(f"request {i}", params):
            pass

    results = await asyncio.wait_for(
        asyncio.gather(*[stream(i) for i in range(3)], return_exceptions=True), 10
    )
    assert all(
        isinstance(r, EngineDeadError) and "simulated device failure" in str(r) for r in results
    ), results
    assert llm.errored
    await llm.shutdown()


async def test_a_request_added_after_the_core_exited_gets_the_cores_reason():
    """The core reports its exception and exits; a request added before the host has
    read that report (the loop is held here until the process is gone) still ends with
    the core's reason, not a bare "process exited"."""
    llm = await _engine_failing_on_its_third_step()
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def stream(prompt):
        async for _ in llm.generate(prompt, params):
            pass

    first = asyncio.create_task(stream({"prompt_token_ids": [1, 2, 3]}))
    await asyncio.sleep(0)  # the first request is sent (token ids: no tokenizer await)
    # Blocks the loop, and so the output handler, until the core's process has exited.
    llm.client.process.proc.wait(timeout=30)
    late = asyncio.create_task(stream({"prompt_token_ids": [4, 5, 6]}))
    try:
        results = await asyncio.wait_for(asyncio.gather(first, late, return_exceptions=True), 10)
    finally:
        await llm.shutdown()
    assert all(
        isinstance(r, EngineDeadError) and "simulated device failure" in str(r) for r in results
    ), results


async def test_sigterm_stops_the_core_and_pending_streams_end():
    llm = await AsyncLLM(**SERVING_ARGS).start()
    pid = llm.engine_core_pid
    got = []

    async def stream():
        async for out in llm.generate("x", SamplingParams(max_tokens=900, ignore_eos=True)):
            got.append(out)

    task = asyncio.create_task(stream())
    try:
        while not got:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 5)
    finally:
        await llm.shutdown()
    assert not _pid_alive(pid)
