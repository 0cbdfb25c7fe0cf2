"""LLM and AsyncLLM share one frontend: the same errors, the same chat rules and the same
stats for the same causes. A model-free executor keeps these fast."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from asyncllm import AsyncLLM, EngineOverloadedError, RequestOutputKind, SamplingParams
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


@pytest.fixture(scope="module")
def instant():
    """One model-free engine (core in this process) for the tests that need no settings
    of their own."""
    with _llm() as llm:
        yield llm


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


def test_a_step_that_raises_one_requests_error_loses_no_other_output():
    """A request refused in the step in which another one finishes: the step raises the
    refusal, and the finished request's output comes with the next step (its state was
    already gone: it would have been lost), as does a second refusal."""
    with _llm(max_num_seqs=1, max_waiting_requests=1) as llm:
        engine = llm.engine
        engine.add_request("A", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
        assert [o.finished for o in engine.step()] == [False]
        for rid in "BCD":  # (B waits; C and D find the queue full)
            engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        finished, refused = [], []
        while engine.has_unfinished_requests():
            try:
                finished += [o.request_id for o in engine.step() if o.finished]
            except EngineOverloadedError as e:
                refused.append(str(e))
        assert sorted(finished) == ["A", "B"] and len(refused) == 2


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
def test_bad_conversations_are_type_errors(messages, instant):
    llm = instant
    with pytest.raises(TypeError, match="messages"):
        llm.chat(messages)


async def test_both_entry_points_report_the_same_stats():
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with _llm() as llm:  # fresh: the counts below start from zero
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


@pytest.mark.parametrize(
    "messages,error,match",
    [
        ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
        ([{"role": "wizard", "content": "hi"}], ValueError, r"messages\[0\]\['role'\]"),
        ([{"content": "hi"}], ValueError, "role"),
        ([{"role": "user", "content": 5}], TypeError, "content"),
    ],
)
def test_chat_messages_are_checked_before_the_template(messages, error, match, instant):
    llm = instant
    with pytest.raises(error, match=match):
        llm.chat(messages)
    # an assistant turn with tool calls may have no content
    ok = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    from asyncllm.frontend.chat import check_conversation

    check_conversation(ok)


def test_n2_registration_is_all_or_nothing(instant):
    llm = instant
    engine = llm.engine
    engine.add_request("1_x", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=4))
    while engine.has_unfinished_requests():  # "1_x" runs to its end
        engine.step()
    # nothing of the refused request stayed registered: "x" is free
    engine.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert [len(c.token_ids) for c in done["x"].outputs] == [4, 4]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def instant_async():
    async with AsyncLLM(**INSTANT) as llm:
        yield llm


async def _aborted_once_started(llm, params, request_id: str, abort_id: str) -> list:
    """Every output of a request whose `abort_id` (itself or a child) is aborted once
    its first output is in."""
    got = []

    async def run():
        async for out in llm.generate("y", params, request_id=request_id):
            got.append(out)

    task = asyncio.create_task(run())
    while not got:  # (its first output)
        await asyncio.sleep(0.01)
    await llm.abort(abort_id)
    await task
    return got


@pytest.mark.asyncio(loop_scope="module")
async def test_aborting_a_child_ends_it_and_the_parent_finishes(instant_async):
    llm = instant_async
    params = SamplingParams(n=2, max_tokens=300, ignore_eos=True)
    got = await _aborted_once_started(llm, params, "y", "0_y")
    # (child 1 runs to its end, child 0 says "abort")
    final = got[-1]
    assert final.finished
    reasons = {c.index: c.finish_reason for c in final.outputs}
    assert reasons == {0: "abort", 1: "length"}
    stats = await llm.get_stats()
    assert stats["num_frontend_requests"] == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_aborting_an_n3_delta_request_ends_every_child(instant_async):
    """DELTA with n = 3, the parent aborted: the last output has each child ended with
    'abort' (as vLLM), not only the one the abort looked at last."""
    params = SamplingParams(
        n=3, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    got = await _aborted_once_started(instant_async, params, "z", "z")
    assert got[-1].finished
    reasons = {c.index: c.finish_reason for c in got[-1].outputs}
    assert reasons == {0: "abort", 1: "abort", 2: "abort"}


def test_an_n2_delta_request_sends_its_prompt_logprobs_once(llm):
    params = SamplingParams(
        n=2, max_tokens=3, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA
    )
    engine = llm.engine  # (the embedded model: real prompt logprobs)
    engine.add_request("pl", {"prompt_token_ids": [5, 6, 7]}, params)
    sent = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            sent += o.prompt_logprobs or []
    # (each position once, though both children computed them; the first has none)
    assert len(sent) == 3 and sent[0] is None and all(p is not None for p in sent[1:])


@pytest.mark.asyncio(loop_scope="module")
async def test_the_host_trims_its_heap_once_idle_after_traffic_and_not_while_busy(
    instant_async, monkeypatch
):
    """After requests, once none is open and the core has gone quiet, the host gives its
    freed C heap back (malloc_trim); never while a request is open."""
    from asyncllm.engine import host_client

    client = instant_async.client
    trims: list[int] = []
    monkeypatch.setattr(host_client, "trim_heap", lambda: trims.append(len(open_)) or True)
    open_: list[str] = []
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    before = client.heap_trims
    async for out in instant_async.generate("t", params, request_id="trim"):
        open_.append(out.request_id)  # (a trim now would see it open)
    open_.clear()
    await client.wait_for_heap_trim(after=before)
    assert trims and set(trims) == {0}  # only with no request open
    assert client.heap_trims == before + len(trims)


@pytest.mark.asyncio(loop_scope="module")
async def test_abort_ends_the_stream_with_an_abort_output_not_a_cancellation(instant_async):
    llm = instant_async
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    outs = []

    async def run():
        async for out in llm.generate("z", params, request_id="z"):
            outs.append(out)
            if len(outs) == 1:
                await llm.abort("z")

    await run()  # returns normally; no CancelledError reaches the consumer
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    await llm.abort("z")  # already over: ignored


def test_delta_outputs_carry_each_prompt_logprob_once(llm):
    from asyncllm import RequestOutputKind

    engine = llm.engine  # the real model: prompt logprobs need logits
    params = SamplingParams(
        max_tokens=3, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA, ignore_eos=True
    )
    engine.add_request("plp", list(range(100, 120)), params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert len(outs) == 3
    sent = [p for o in outs for p in (o.prompt_logprobs or [])]
    assert len(sent) == 20 and sent[0] is None and all(p is not None for p in sent[1:])
    # As vLLM: the outputs after the one that carried them hold [] (None means that
    # prompt logprobs were not asked for), so code that extends a list with them works.
    assert [o.prompt_logprobs for o in outs[1:]] == [[], []]
    engine.add_request("none", list(range(100, 120)), params.clone(prompt_logprobs=None))
    while engine.has_unfinished_requests():
        assert all(o.prompt_logprobs is None for o in engine.step())


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(include, instant):
    llm = instant
    tok = llm.get_tokenizer()
    # The model-free executor answers 1000 + position: 1003, then 1004 for this prompt.
    params = SamplingParams(
        max_tokens=10, stop_token_ids=[1004], include_stop_str_in_output=include
    )
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [1003, 1004]
    assert out.finish_reason == "stop" and out.stop_reason == 1004
    assert out.text == tok.decode([1003, 1004] if include else [1003])


@pytest.mark.parametrize("include", [False, True])
def test_the_eos_text_is_left_out_even_with_special_tokens_shown(include, llm):
    """The issue's second case, on the real model: EOS forced by a logit bias, special
    tokens not skipped; its text is in the output only if asked for."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    params = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        logit_bias={eos: 100.0},
        skip_special_tokens=False,
        include_stop_str_in_output=include,
    )
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    assert out.text == (tok.decode([eos]) if include else "")
    assert tok.decode([eos])  # (the EOS has a text to leave out)


def test_tpot_counts_every_token_of_a_delta_stream(instant):
    from asyncllm import RequestOutputKind

    llm = instant
    engine = llm.engine
    params = SamplingParams(max_tokens=6, output_kind=RequestOutputKind.DELTA, ignore_eos=True)

    def total(h):
        return (h["mean"] or 0.0) * h["count"]

    before = engine.get_stats()["tpot_s"]
    engine.add_request("d", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    after = engine.get_stats()["tpot_s"]
    assert after["count"] == before["count"] + 1
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6  # (deltas: 1 or more each)
    m = outs[-1].metrics  # the value is over all 6 tokens, not the last delta's
    want = (m["finished_time"] - m["first_token_time"]) / 5
    assert total(after) - total(before) == pytest.approx(want, rel=1e-6, abs=1e-9)


async def test_a_failed_start_raises_startup_error_and_can_be_retried(tmp_path):
    from asyncllm import EngineStartupError
    from asyncllm.model.source import embedded_model_path

    model = tmp_path / "missing"
    llm = AsyncLLM(
        model=str(model),
        device="cpu",
        distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
    )
    for _ in range(2):  # the second attempt is a real retry, not "already started"
        with pytest.raises(EngineStartupError, match="does not exist") as info:
            await llm.start()
        assert isinstance(info.value.__cause__, FileNotFoundError)
        assert not llm.is_running
    model.symlink_to(embedded_model_path(), target_is_directory=True)  # the cause, fixed
    await llm.start()  # the same instance starts now
    try:
        outs = [o async for o in llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    finally:
        await llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_start_up_failures_are_startup_errors_with_their_cause(multiprocess):
    """LLM raises what AsyncLLM.start() raises: EngineStartupError, the cause chained,
    with the core in this process or in its own."""
    from asyncllm import LLM, EngineStartupError

    with pytest.raises(EngineStartupError, match="no/such/model") as info:
        LLM(model="/no/such/model", device="cpu", multiprocess=multiprocess)
    assert isinstance(info.value.__cause__, FileNotFoundError)


class _CountingTokenizer:
    """The real tokenizer, counting the texts it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_text_no_tokenization_could_fit_is_refused_without_tokenizing(instant, monkeypatch):
    """Refused at once past max_model_len x the longest vocabulary entry's bytes; text at
    exactly that many bytes is tokenized (it might fit), then judged by its tokens."""
    ip = instant.engine.frontend.input_processor
    counting = _CountingTokenizer(ip.tokenizer)
    monkeypatch.setattr(ip, "tokenizer", counting)
    limit = ip.max_model_len * ip.max_token_bytes()
    assert ip.max_token_bytes() >= 8  # a real vocabulary has long entries
    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="bytes of text"):
        instant.generate("é" * (limit // 2 + 1), params, use_tqdm=False)  # 2 bytes a char
    assert counting.calls == 0
    with pytest.raises(ValueError, match="max_model_len"):
        instant.generate("a" * limit, params, use_tqdm=False)
    assert counting.calls == 1
    (out,) = instant.generate("a " * 100, params, use_tqdm=False)  # fits
    assert len(out.outputs[0].token_ids) == 1 and counting.calls == 2


def test_llm_made_inside_a_running_event_loop_warns():
    async def make_one() -> None:
        with pytest.warns(RuntimeWarning, match="AsyncLLM"):
            llm = _llm()
        llm.shutdown()

    asyncio.run(make_one())


async def test_async_llm_sets_requests_up_off_the_loop():
    """Text prompts are tokenized, and chat templates rendered, in the setup thread; a
    prompt of token ids needs neither."""
    import threading

    async with AsyncLLM(**INSTANT) as llm:
        frontend = llm.frontend
        threads: list[str] = []
        tokenize, chat_prompt = frontend.tokenize_prompts, frontend.chat_prompt

        def spy(fn):
            def wrapped(*args, **kwargs):
                threads.append(threading.current_thread().name)
                return fn(*args, **kwargs)

            return wrapped

        frontend.tokenize_prompts = spy(tokenize)
        frontend.chat_prompt = spy(chat_prompt)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        streams = [
            llm.generate("Hello there", params),
            llm.chat([{"role": "user", "content": "Hi"}], params),
            llm.generate([1, 2, 3], params),
        ]
        for stream in streams:
            outs = [out async for out in stream]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
        assert len(threads) == 2 and all(t.startswith("asyncllm-setup") for t in threads)
        with pytest.raises(ValueError, match="prompt must not be empty"):  # still raised
            await anext(llm.generate("", params))


async def test_async_llm_tokenizes_prompts_that_arrive_together_in_one_call():
    """Five text prompts started in one loop pass: one tokenizer call for all five; a
    bad one among them fails alone."""
    async with AsyncLLM(**INSTANT) as llm:
        frontend = llm.frontend
        batches: list[int] = []
        tokenize = frontend.tokenize_prompts

        def spy(prompts):
            batches.append(len(prompts))
            return tokenize(prompts)

        frontend.tokenize_prompts = spy
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        too_long = "x" * (llm.config.max_model_len * 10_000)

        async def run(prompt):
            return [out async for out in llm.generate(prompt, params)]

        prompts = ["Hello there", "One", too_long, "Two three", "Four"]
        results = await asyncio.gather(*[run(p) for p in prompts], return_exceptions=True)
        assert batches == [5]
        assert isinstance(results[2], ValueError) and "max_model_len" in str(results[2])
        for i in (0, 1, 3, 4):
            outs = results[i]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
            want = llm.tokenizer(prompts[i]).input_ids
            assert outs[-1].prompt_token_ids == want


def test_tokenize_prompts_matches_one_at_a_time():
    """The batched call gives each text the ids of tokenizing it alone; bad prompts get
    their own error in their place."""
    with _llm() as llm:
        tok = llm.get_tokenizer()
        prompts = ["Hello there", [5, 6, 7], {"prompt": "A dict"}, "", {"bad": 1}, "héllo 🙂", 3]
        got = llm.engine.frontend.tokenize_prompts(prompts)
        assert got[0] == ("Hello there", tok("Hello there").input_ids)
        assert got[1] == (None, [5, 6, 7])
        assert got[2] == ("A dict", tok("A dict").input_ids)
        assert isinstance(got[3], ValueError) and "must not be empty" in str(got[3])
        assert isinstance(got[4], ValueError) and "unknown keys" in str(got[4])
        assert got[5] == ("héllo 🙂", tok("héllo 🙂").input_ids)
        assert isinstance(got[6], TypeError) and "prompt must be" in str(got[6])


def test_start_up_objects_are_frozen_while_an_engine_runs(monkeypatch):
    import gc

    monkeypatch.setenv("ASYNCLLM_GC_FREEZE", "1")
    gc.unfreeze()
    with _llm() as llm:
        assert gc.get_freeze_count() > 10_000  # torch's, transformers', the tokenizer's
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert gc.get_freeze_count() == 0  # collected as usual again
    monkeypatch.setenv("ASYNCLLM_GC_FREEZE", "0")
    with _llm():
        assert gc.get_freeze_count() == 0
