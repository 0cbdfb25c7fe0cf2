"""MultiprocExecutor end to end on the CPU: tensor parallelism through worker processes
(gloo over loopback, one torch thread per worker, float32) against the one-process
executor, AsyncLLM over it, and its faults.

Engines are shared where a test leaves them usable (module-scoped; the models and the
TP=1 reference come from conftest.py), and the models are tiny (two layers, a vocabulary of 384); a TP=2 engine in this process starts in about
1.5 s on a 2-CPU machine. "Equal" greedy outputs follow DESIGN.md's tie rule (sharded
sums add in another order): a divergence only where the reference's two best logits
(read from its top-2 logprobs, which differ from the logits by one constant per
position) are within 1e-3.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncllm import (
    LLM,
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    EngineStartupError,
    SamplingParams,
)
from asyncllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.distributed.engines import (
    GREEDY,
    PROMPTS,
    TINY,
    StreamTokens,
    as_inputs,
    assert_equal_under_tie_rule,
    check_greedy_with_preemption_and_prefix_hits,
    check_seeded_sampling_and_logprobs,
    children,
    shm_segments,
    token_ids,
    wait_gone,
    worker_pids,
)

# -- models and engines ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_llama(tiny_models):
    """TP=2 over the llama3 model, in this process's core, with a KV cache of 16 blocks:
    the eight prompts (24 blocks at once) preempt each other."""
    llm = LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        tensor_parallel_size=2,
        num_gpu_blocks_override=16,
        **TINY,
    )
    yield llm
    llm.shutdown()


def _executor(llm: LLM):
    return llm.engine.client.core.executor


# -- model level -----------------------------------------------------------------------


def test_tp2_greedy_equals_tp1_with_preemption_and_prefix_hits(tp2_llama, reference):
    _, ref = reference
    executor = _executor(tp2_llama)
    assert type(executor).__name__ == "MultiprocExecutor" and len(executor.worker_pids) == 2
    check_greedy_with_preemption_and_prefix_hits(tp2_llama, ref["llama3"], "llama3 TP=2")


def test_tp2_with_one_kv_head_replicated_and_drafts_equals_tp1(tiny_models, reference):
    """Also speculative decoding: each rank gets the step's drafts and verifies them."""
    _, ref = reference
    # (every prompt drafts: fewer than 32 at once)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": 32}  # fmt: skip
    with LLM(
        str(tiny_models["qwen2"]),
        multiprocess=False,
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        async_scheduling=False,  # (the one-step-at-a-time path, here)
        speculative_config=spec,
        **TINY,
    ) as llm:
        outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert_equal_under_tie_rule(ref["qwen2"], outs, "qwen2 (1 KV head) TP=2, drafts")
    assert stats["spec_num_accepted_tokens"] > 0, stats


def test_mp_at_one_rank_gives_the_in_processtoken_ids(tiny_models, reference):
    """One worker process (the executor's process hop alone): the same tokens."""
    _, ref = reference
    with LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        distributed_executor_backend="mp",
        num_gpu_blocks_override=64,
        **TINY,
    ) as llm:
        assert len(_executor(llm).worker_pids) == 1
        outs = llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
    assert token_ids(outs) == token_ids(ref["llama3"])


def test_tp2_seeded_sampling_and_logprobs_equal_tp1(tp2_llama, reference):
    check_seeded_sampling_and_logprobs(reference[0], tp2_llama)


def test_tp3_smollm_equals_tp1_with_structured_outputs_and_drafts(llm, smollm_prompts):
    """SmolLM2 (9 heads, 3 KV heads) over three workers on two CPUs, speculation on: a
    few prompts, few tokens, a request constrained by a choice (its bitmask goes with
    the step), and a constrained request that drafts (a row per draft goes too)."""
    prompts = as_inputs(smollm_prompts[1:4])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    choice = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
    )
    number = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Repeat this number: 31415926535897932384"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    digits = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="[0-9]{20}"),
    )
    want = llm.generate(prompts, greedy, use_tqdm=False)
    want_choice = llm.generate(prompts[:1], choice, use_tqdm=False)
    want_digits = llm.generate([number], digits, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    with LLM(
        multiprocess=False,
        device="cpu",
        tensor_parallel_size=3,
        max_model_len=512,
        num_gpu_blocks_override=32,
        cpu_threads=1,
        speculative_config=spec,
    ) as tp3:
        got = tp3.generate(prompts, greedy, use_tqdm=False)
        got_choice = tp3.generate(prompts[:1], choice, use_tqdm=False)
        got_digits = tp3.generate([number], digits, use_tqdm=False)
        accepted = tp3.get_stats()["spec_num_accepted_tokens"]
    assert_equal_under_tie_rule(want, got, "SmolLM2 TP=3")
    assert got_choice[0].outputs[0].text == want_choice[0].outputs[0].text
    assert got_choice[0].outputs[0].text in ("Paris", "London", "Rome")
    assert got_digits[0].outputs[0].token_ids == want_digits[0].outputs[0].token_ids
    assert accepted > 0


# -- configuration -----------------------------------------------------------------------


def test_a_size_the_model_cannot_shard_is_refused_before_any_worker_starts():
    from asyncllm.engine.core_config import create_engine_config

    before = set(children(os.getpid()))
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 cannot shard .*9 attention heads and 3 KV heads"
    ):
        create_engine_config(EngineArgs(device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=31 cannot split .*30 layers"):
        create_engine_config(EngineArgs(device="cpu", pipeline_parallel_size=31))
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    config = create_engine_config(EngineArgs(device="cpu"))
    assert config.parallel.distributed_executor_backend == "uni"
    assert set(children(os.getpid())) <= before


def test_the_config_crosses_to_a_worker_as_plain_data():
    import msgspec

    from asyncllm.engine.core_config import create_engine_config
    from asyncllm.executor.multiproc_messages import config_to_plain
    from asyncllm.executor.multiproc_worker import config_from_plain

    config = create_engine_config(EngineArgs(device="cpu", scheduling_policy="priority"))
    plain = config_to_plain(config)
    back = config_from_plain(msgspec.msgpack.decode(msgspec.msgpack.encode(plain)))
    assert config_to_plain(back) == plain
    assert back.model.dtype == config.model.dtype and back.scheduler == config.scheduler


# -- faults ----------------------------------------------------------------------------


def test_a_stalled_worker_ends_in_the_timeout_error(tiny_models, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S", "2")
    llm = LLM(
        str(tiny_models["llama3"]),
        multiprocess=False,
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        **TINY,
    )
    pids = _executor(llm).worker_pids
    try:
        os.kill(pids[1], signal.SIGSTOP)  # (rank 0 then waits in a collective for it)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S=2") as e:
            llm.generate(as_inputs(PROMPTS[:2]), GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 10
        assert isinstance(e.value.__cause__, TimeoutError)
    finally:
        llm.shutdown()
    assert wait_gone(pids, 5) == []


def test_a_worker_that_never_starts_ends_in_the_start_timeout(tiny_models, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_WORKER_START_TIMEOUT_S", "3")
    before = set(children(os.getpid()))
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"worker rank\(s\) \[0, 1\] did not start within"):
        LLM(
            str(tiny_models["llama3"]),
            multiprocess=False,
            tensor_parallel_size=2,
            distributed_executor_backend="tests.distributed.engines:StallingExecutor",
            **TINY,
        )
    assert time.monotonic() - t0 < 15
    assert wait_gone(list(set(children(os.getpid())) - before), 5) == []


def test_a_worker_error_at_start_up_is_raised_as_is_and_leaves_nothing(tiny_models):
    before = set(children(os.getpid()))
    shm_before = shm_segments()
    with pytest.raises(EngineStartupError, match="the KV cache has room for 2 blocks") as e:
        LLM(
            str(tiny_models["llama3"]),
            multiprocess=False,
            tensor_parallel_size=2,
            num_gpu_blocks_override=2,
            **TINY,
        )
    assert isinstance(e.value.__cause__, ValueError)  # (the workers' error, as it was)
    assert wait_gone(list(set(children(os.getpid())) - before), 5) == []
    assert shm_segments() <= shm_before


# -- AsyncLLM over the multiprocess executor (an engine-core process) ------------------


async def _start(tiny_models) -> AsyncLLM:
    return await AsyncLLM(
        str(tiny_models["llama3"]), tensor_parallel_size=2, num_gpu_blocks_override=64, **TINY
    ).start()


async def test_async_llm_streams_cancels_frees_blocks_and_shuts_down_cleanly(
    tiny_models, reference, capfd
):
    _, ref = reference
    shm_before = shm_segments()
    llm = await _start(tiny_models)
    core_pid = llm.engine_core_pid
    assert core_pid is not None
    workers = worker_pids(core_pid)
    assert len(workers) == 2
    stream = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def collect(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate({"prompt_token_ids": PROMPTS[i]}, stream):
            tokens += out.outputs[0].token_ids
        return tokens

    async def cancelled(i: int, started: asyncio.Event) -> None:
        async for _ in llm.generate({"prompt_token_ids": PROMPTS[i]}, long):
            started.set()

    started = [asyncio.Event(), asyncio.Event()]
    doomed = [asyncio.create_task(cancelled(i, started[i])) for i in range(2)]
    streams = await asyncio.gather(*(collect(i) for i in range(2, 6)))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    for task in doomed:
        task.cancel()
    await asyncio.gather(*doomed, return_exceptions=True)
    assert_equal_under_tie_rule(
        ref["llama3"][2:6],
        [StreamTokens(t) for t in streams],
        "AsyncLLM TP=2 streams",
    )
    deadline = time.monotonic() + 10
    while True:  # (the aborts reach the core after the streams end)
        stats = await llm.get_stats()
        if stats["num_free_blocks"] == stats["num_blocks"] == 64 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert stats["num_free_blocks"] == stats["num_blocks"] == 64, stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    capfd.readouterr()
    t0 = time.monotonic()
    await llm.shutdown()
    assert time.monotonic() - t0 < 5
    assert wait_gone([core_pid, *workers], 5) == []
    err = capfd.readouterr().err
    for bad in ("ERROR", "Traceback", "leaked", "Warning"):
        assert bad not in err, err
    assert shm_segments() <= shm_before


async def test_a_worker_killed_mid_step_kills_the_engine_promptly(tiny_models):
    shm_before = shm_segments()
    llm = await _start(tiny_models)
    core_pid = llm.engine_core_pid
    workers = worker_pids(core_pid)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()

    async def stream(i: int) -> None:
        async for _ in llm.generate({"prompt_token_ids": PROMPTS[i]}, params):
            started.set()

    tasks = [asyncio.create_task(stream(i)) for i in range(4)]
    await asyncio.wait_for(started.wait(), 30)
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert time.monotonic() - t0 < 10
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "worker rank 1" in str(results[0]) and "SIGKILL" in str(results[0]), results[0]
    await llm.shutdown()
    assert wait_gone([core_pid, *workers], 10) == []
    assert shm_segments() <= shm_before


async def test_a_worker_that_dies_while_the_engine_is_idle_kills_it(tiny_models):
    llm = await _start(tiny_models)
    core_pid = llm.engine_core_pid
    workers = worker_pids(core_pid)
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not llm.errored and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert llm.errored
    with pytest.raises(EngineDeadError, match="worker rank 0"):
        await llm.check_health()
    await llm.shutdown()
    assert wait_gone([core_pid, *workers], 10) == []


async def test_a_killed_engine_core_takes_its_workers_with_it(tiny_models):
    llm = await _start(tiny_models)
    core_pid = llm.engine_core_pid
    workers = worker_pids(core_pid)
    assert len(workers) == 2
    os.kill(core_pid, signal.SIGKILL)
    assert wait_gone(workers, 10) == []
    with pytest.raises(EngineDeadError):
        async for _ in llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY):
            pass
    await llm.shutdown()
