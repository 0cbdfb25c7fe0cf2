"""AsyncLLM streams: many at once, every output kind, cancellation, a responsive loop."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import random
import threading

import pytest

from asyncllm import EngineDeadError, RequestOutputKind, SamplingParams
from tests.serving.conftest import LoopTicker

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = [
    "The capital of France is",
    "日本の首都は",
    "Emoji story: 🐍🎉",
    "def add(a, b):",
    "Once upon a time",
    "Les fleurs du printemps",
    "1, 1, 2, 3, 5, 8,",
    "Москва — столица",
]


async def _collect(llm, prompt, params, request_id=None):
    outs = []
    async for out in llm.generate(prompt, params, request_id=request_id):
        outs.append(out)
    return outs


async def _wait_idle(llm, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await llm.get_stats()
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_blocks"]:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        await asyncio.sleep(0.05)


async def test_128_concurrent_streams_equal_llm_generate(allm, llm):
    kinds = list(RequestOutputKind)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(128)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=kinds[i % 3])
        for i in range(128)
    ]
    streams = await asyncio.gather(*[_collect(allm, p, sp) for p, sp in zip(prompts, params)])
    want = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    for i, (stream, ref) in enumerate(zip(streams, want)):
        kind = kinds[i % 3]
        final = stream[-1]
        assert final.finished and not any(o.finished for o in stream[:-1])
        deltas = "".join(o.outputs[0].delta for o in stream)
        assert all("\ufffd" not in o.outputs[0].delta for o in stream)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(stream) == 1
        if kind is RequestOutputKind.DELTA:
            tokens = [t for o in stream for t in o.outputs[0].token_ids]
            assert "".join(o.outputs[0].text for o in stream) == deltas
        else:
            tokens = final.outputs[0].token_ids
            assert final.outputs[0].text == deltas
        assert tokens == ref.outputs[0].token_ids, f"stream {i} differs from LLM.generate"
        assert deltas == ref.outputs[0].text
    await _wait_idle(allm)


async def test_cancellation_storm_leaves_the_engine_clean(allm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    rng = random.Random(0)

    async def complete(i):
        outs = await _collect(allm, PROMPTS[i % 8], params)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
        return "done"

    async def break_after_3(i):
        n = 0
        async for _ in allm.generate(
            PROMPTS[i % 8], params.clone(output_kind=RequestOutputKind.DELTA)
        ):
            n += 1
            if n == 3:
                break
        return "broke"

    async def timed_out(i):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0.05, 0.5)):
                await _collect(allm, PROMPTS[i % 8], params)
        return "timeout"

    tasks, to_cancel = [], []
    for i in range(100):
        if i % 2 == 0:
            tasks.append(asyncio.create_task(complete(i)))
        elif i % 6 == 1:
            tasks.append(asyncio.create_task(break_after_3(i)))
        elif i % 6 == 3:
            tasks.append(asyncio.create_task(timed_out(i)))
        else:
            t = asyncio.create_task(_collect(allm, PROMPTS[i % 8], params))
            tasks.append(t)
            to_cancel.append(t)
    await asyncio.sleep(0.3)
    for t in to_cancel:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert results[0::2] == ["done"] * 50
    cancelled = [r for r in results[1::2] if isinstance(r, asyncio.CancelledError)]
    assert len(cancelled) + sum(r in ("broke", "timeout") for r in results[1::2]) == 50
    assert not [r for r in results if isinstance(r, Exception)]
    stats = await _wait_idle(allm)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert allm.is_running and not allm.errored


async def test_host_loop_stays_responsive_during_64_streams(allm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    async with LoopTicker() as ticker:
        await asyncio.gather(
            *[_collect(allm, PROMPTS[i % 8] + " " * (i % 5), params) for i in range(64)]
        )
    assert len(ticker.gaps) > 10 and ticker.worst_gap < 1.0, f"worst gap {ticker.worst_gap:.3f} s"


async def test_ready_handshake_carries_what_the_client_needs(allm):
    config, info = allm.client.config, allm.client.info  # (CONFIG, then READY)
    assert config.max_model_len == 1024 and config.vocab_size == 49152
    assert info.num_blocks > 0 and config.block_size == 16


async def test_malformed_frames_are_dropped_and_the_core_keeps_serving(allm):
    sock = allm.client.input
    sock.send_multipart([b"A", b"\x92\x01not msgpack at all"])
    sock.send_multipart([b"A", pickle.dumps({"request_id": "evil"})])
    sock.send_multipart([pickle.dumps(("ADD", "x"))])
    sock.send_multipart([b"Z", b"\x90"])
    outs = await _collect(allm, "Still alive?", SamplingParams(max_tokens=4, temperature=0.0))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    await allm.check_health()


async def test_bad_input_raises_before_sending_and_engine_serves_on(allm):
    with pytest.raises(ValueError, match="empty"):
        await _collect(allm, "", None)
    with pytest.raises(ValueError, match="token id"):
        await _collect(allm, [1, 10**7], None)
    with pytest.raises(TypeError, match="sampling_params"):
        await _collect(allm, "hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    outs = await _collect(allm, "fine", SamplingParams(max_tokens=2))
    assert outs[-1].finished


async def test_chat_abort_health_and_stats(allm):
    text = ""
    async for out in allm.chat(
        [{"role": "user", "content": "Say hi"}],
        SamplingParams(max_tokens=8, temperature=0.0, output_kind=RequestOutputKind.DELTA),
    ):
        text += out.outputs[0].delta
    assert text.strip()

    async def long_one():
        return await _collect(
            allm,
            "Tell a long story",
            SamplingParams(max_tokens=500, ignore_eos=True),
            request_id="abort-me",
        )

    task = asyncio.create_task(long_one())
    while (await allm.get_stats())["num_running"] == 0:  # until it runs in the core
        await asyncio.sleep(0.01)
    await allm.abort("abort-me")
    outs = await task  # the stream ends normally, its last output saying "abort"
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 500
    await _wait_idle(allm)
    stats = await allm.get_stats()
    assert stats["ttft_s"]["count"] > 0 and stats["tpot_s"]["count"] > 0
    assert stats["queue_time_s"]["count"] > 0 and stats["queue_time_s"]["mean"] >= 0
    assert sum(stats["e2e_latency_s"]["counts"]) == stats["e2e_latency_s"]["count"]
    assert 0.0 <= stats["prefix_cache_hit_rate"] <= 1.0
    await allm.check_health()


async def test_a_slow_consumer_gets_merged_deltas(allm):
    stream = allm.generate(
        "Count slowly:",
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        ),
    )
    first = await stream.__anext__()
    collector = allm._collectors[first.request_id]
    # Consume nothing until the engine has finished the request: every later step's
    # delta must be waiting, merged into one output.
    while collector.output is None or not collector.output.finished:
        await asyncio.sleep(0.01)
    rest = [o async for o in stream]
    tokens = first.outputs[0].token_ids + [t for o in rest for t in o.outputs[0].token_ids]
    assert len(tokens) == 30
    assert len(rest) == 1 and rest[0].finished


async def test_using_it_from_another_loop_is_a_clear_error(allm):
    errors = []

    def other_thread():
        async def use():
            async for _ in allm.generate("hi", SamplingParams(max_tokens=2)):
                pass

        try:
            asyncio.run(use())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "event loop" in str(errors[0]) and not isinstance(errors[0], EngineDeadError)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_id_is_taken_while_its_prompt_is_tokenized(allm):
    """A request's id is its generator's from the start, the tokenizer's wait included:
    another request with that id meanwhile is refused (it would have taken over the
    first one's stream), and the first one streams to its end."""
    held = threading.Event()
    allm._setup._pool.submit(held.wait)  # (the setup thread busy: tokenizing waits)
    first = allm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), request_id="dup")
    waiting = asyncio.ensure_future(first.__anext__())
    while not allm._setup._busy:  # (its first steps, up to the tokenizer's wait)
        await asyncio.sleep(0)
    assert "dup" in allm._collectors
    ids = [1, 2, 3]
    with pytest.raises(ValueError, match="already in use"):
        await allm.generate(ids, SamplingParams(max_tokens=1), request_id="dup").__anext__()
    held.set()
    outs = [await waiting] + [o async for o in first]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert "dup" not in allm._collectors
