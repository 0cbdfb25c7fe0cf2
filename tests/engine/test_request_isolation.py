"""One bad request never harms the others, nor the engine.

- SamplingParams bounds every number (a ValueError or TypeError naming the field, never
  an OverflowError later), and extra_args must be plain data the wire carries;
- seed=-1 means unseeded, as in vLLM;
- the frontend bounds priority; EngineCore.add_request checks what a socket may bring;
- a request that cannot be scheduled is ended with an error, and a stuck step never
  turns into a core that spins;
- a bad value that reaches the model runner fails that request alone: the rest of its
  batch completes and the engine serves on.

Model-free engines (the instant executor) for the frontend and the scheduler; a tiny
random Llama, in this process, for the model runner.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from asyncllm import LLM, RequestFailedError, SamplingParams
from asyncllm.config import EngineArgs
from asyncllm.core.request import Request
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_config import create_engine_config
from asyncllm.messages import EngineCoreRequest, ErrorKind
from tests.model.tiny import make_tiny_model

INSTANT = "asyncllm.executor.instant:InstantExecutor"
BIG = 2**70

# -- SamplingParams --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,field",
    [
        ({"top_k": 2**63, "temperature": 0.8}, ValueError, "top_k"),
        ({"top_k": BIG}, ValueError, "top_k"),
        ({"top_k": 2**31}, ValueError, "top_k"),
        ({"max_tokens": BIG}, ValueError, "max_tokens"),
        ({"max_tokens": 2**63}, ValueError, "max_tokens"),
        ({"min_tokens": BIG, "max_tokens": None}, ValueError, "min_tokens"),
        ({"n": BIG}, ValueError, "n"),
        ({"n": 2**16 + 1}, ValueError, "n"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": BIG}, ValueError, "seed"),
        ({"seed": -(2**63) - 1}, ValueError, "seed"),
        ({"logprobs": BIG}, ValueError, "logprobs"),
        ({"prompt_logprobs": 2**63}, ValueError, "prompt_logprobs"),
        ({"stop_token_ids": [2**63]}, ValueError, "stop_token_ids"),
        ({"logit_bias": {2**63: 1.0}}, ValueError, "logit_bias"),
        ({"logit_bias": {5: 1e39}}, ValueError, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, ValueError, "logit_bias"),
        ({"logit_bias": {5: BIG**20}}, ValueError, "logit_bias"),
        ({"temperature": 10**400}, ValueError, "temperature"),
        ({"temperature": 1e39}, ValueError, "temperature"),
        ({"repetition_penalty": math.inf}, ValueError, "repetition_penalty"),
        ({"output_kind": 7}, ValueError, "output_kind"),
        ({"output_kind": -1}, ValueError, "output_kind"),
        ({"output_kind": "delta"}, TypeError, "output_kind"),
        ({"max_tokens": 10**5000}, ValueError, "max_tokens"),  # str() of it would raise
        ({"extra_args": {1: "a"}}, TypeError, "extra_args"),
        ({"extra_args": {"a": {2: "b"}}}, TypeError, "extra_args"),
        ({"extra_args": {"a": object()}}, TypeError, "extra_args"),
        ({"extra_args": {"a": b"bytes"}}, TypeError, "extra_args"),
        ({"extra_args": {"a": [1, {"b": BIG}]}}, ValueError, "extra_args"),
        ({"extra_args": [("a", 1)]}, TypeError, "extra_args"),
    ],
)
def test_every_number_is_bounded_and_every_error_names_its_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted():
    SamplingParams(
        top_k=2**31 - 1,
        max_tokens=2**63 - 1,
        min_tokens=2**63 - 1,
        seed=2**64 - 1,
        n=2**16,
        logit_bias={2**31 - 1: -math.inf, 0: 100.0},
        extra_args={"a": [1, 2.5, None, True, {"b": "c"}], "big": 2**64 - 1},
    )
    SamplingParams(seed=-(2**63), top_k=-1)


def test_a_changed_object_is_checked_again_by_verify():
    params = SamplingParams()
    params.top_k = 2**63
    with pytest.raises(ValueError, match="top_k"):
        params.verify()


def test_seed_minus_one_means_unseeded_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=5).clone(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2  # any other seed is a seed


# -- the frontend and the core's checks (no model) -------------------------------------


@pytest.fixture(scope="module")
def instant_llm():
    engine = LLM(
        multiprocess=False, device="cpu", max_model_len=1024, distributed_executor_backend=INSTANT
    )
    yield engine
    engine.shutdown()


def _core(llm: LLM) -> EngineCore:
    core = llm.engine.client.core  # type: ignore[attr-defined]
    assert isinstance(core, EngineCore)
    return core


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1, BIG, -BIG])
def test_priority_out_of_int64_names_the_field(instant_llm, priority):
    with pytest.raises(ValueError, match="priority"):
        instant_llm.generate(
            ["fine", "bad"], SamplingParams(max_tokens=2), priority=[0, priority], use_tqdm=False
        )
    out = instant_llm.generate(
        "ok", SamplingParams(max_tokens=2), priority=[2**63 - 1], use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_frontend_checks_a_changed_object_again(instant_llm):
    """A params object changed after it was made would fail to decode in the core's
    process (a dropped message: the request would hang)."""
    params = SamplingParams(max_tokens=2)
    params.extra_args = {1: "a"}
    with pytest.raises(TypeError, match="extra_args"):
        instant_llm.engine.add_request("changed", "hi", params)
    assert not instant_llm.engine.has_unfinished_requests()


_ids = itertools.count()


def _request(prompt: list[int], max_tokens: int = 4, **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=None,
        max_tokens=max_tokens,
        arrival_time=time.monotonic(),
    )


def _bad_params(**changes: Any) -> SamplingParams:
    params = SamplingParams()
    for k, v in changes.items():
        setattr(params, k, v)  # past __post_init__, as a changed object would be
    return params


@pytest.mark.parametrize(
    "changes,error,match",
    [
        ({"prompt_token_ids": []}, ValueError, "empty"),
        ({"prompt_token_ids": [1] * 1025}, ValueError, "max_model_len"),  # (1024: accepted)
        ({"prompt_token_ids": [1, 49152]}, ValueError, "token id 49152"),
        ({"prompt_token_ids": [1, -1]}, ValueError, "token id -1"),
        ({"prompt_token_ids": [1, 2.0]}, TypeError, "prompt_token_ids"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"eos_token_id": -3}, ValueError, "eos_token_id"),
        ({"priority": 2**63}, ValueError, "priority"),
        ({"arrival_time": math.nan}, ValueError, "arrival_time"),
        ({"request_id": ""}, TypeError, "request_id"),
        ({"sampling_params": {"top_k": 1}}, TypeError, "sampling_params"),
        ({"sampling_params": _bad_params(top_k=2**63)}, ValueError, "top_k"),
        ({"sampling_params": _bad_params(stop_token_ids=[49152])}, ValueError, "stop_token_ids"),
        ({"sampling_params": _bad_params(logit_bias={49152: 1.0})}, ValueError, "logit_bias"),
        ({"sampling_params": _bad_params(logprobs=21)}, ValueError, "max_logprobs"),
    ],
)
def test_the_core_refuses_what_the_frontend_would_never_send(instant_llm, changes, error, match):
    """Possible through the socket; core_main answers such a ValueError/TypeError with an
    INVALID error output for that request."""
    core = _core(instant_llm)
    req = msgspec.structs.replace(_request([1, 2, 3]), **changes)
    with pytest.raises(error, match=match):
        core.add_request(req)
    assert req.request_id not in core.scheduler.requests
    assert not core.has_unfinished_requests() and not core.has_pending_outputs()


def test_max_tokens_past_max_model_len_is_capped(instant_llm):
    core = _core(instant_llm)
    req = msgspec.structs.replace(_request([1] * 1000), max_tokens=2**62)
    core.add_request(req)
    assert core.scheduler.requests[req.request_id].max_tokens == 24
    results = _run(core, [])
    assert len(results[req.request_id].tokens) == 24


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: tuple[ErrorKind, str] | None = None


def _run(
    core: EngineCore, reqs: list[EngineCoreRequest], max_steps: int = 300
) -> dict[str, Result]:
    """Adds the requests and steps the core as its process does (while anything is
    unfinished or pending); every step must have outputs, or the loop would spin
    sending empty messages."""
    for r in reqs:
        core.add_request(r)
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests() and not core.has_pending_outputs():
            return results
        out = core.step()
        assert out.outputs, "a step with nothing to report: the core loop would spin"
        for o in out.outputs:
            r = results.setdefault(o.request_id, Result())
            r.tokens += o.new_token_ids
            r.finish_reason = o.finish_reason
            if o.error is not None:
                r.error = (o.error.kind, o.error.message)
    raise AssertionError(f"the core is stuck with {core.scheduler.requests}")


def _inject(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
    """Straight into the scheduler, past add_request's checks."""
    params = SamplingParams(max_tokens=max_tokens)
    core.scheduler.add_request(Request(rid, prompt, params, None, max_tokens))


def test_requests_that_cannot_be_scheduled_fail_and_the_core_goes_idle(instant_llm):
    core = _core(instant_llm)
    _inject(core, "empty", [])
    _inject(core, "too-long", [5] * 1500)
    ok = _request([1, 2, 3], max_tokens=3)
    results = _run(core, [ok])
    for rid in ("empty", "too-long"):
        assert results[rid].finish_reason == "abort"
        assert results[rid].error is not None and results[rid].error[0] is ErrorKind.INVALID
    assert results[ok.request_id].tokens == [1003, 1004, 1005]
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


def test_requests_larger_than_the_whole_kv_cache_fail(instant_llm):
    base = _core(instant_llm).config
    config = dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, num_gpu_blocks_override=4)
    )
    core = EngineCore(config)  # 4 blocks of 16 tokens
    huge, grows, ok = _request([1] * 100), _request([1] * 60, max_tokens=20), _request([1, 2], 3)
    results = _run(core, [huge, grows, ok])
    for req, produced in ((huge, 0), (grows, 5)):  # 64 slots: 60 + 5 tokens do not fit
        r = results[req.request_id]
        assert (
            r.error is not None
            and r.error[0] is ErrorKind.FAILED
            and "the 4 there are" in r.error[1]
        )
        assert len(r.tokens) == produced and r.finish_reason == "abort"
    assert len(results[ok.request_id].tokens) == 3
    assert core.kv_cache_manager.num_free_blocks == 4
    assert _run(core, [_request([7, 8], 2)])  # and it serves on


def test_a_step_that_could_change_nothing_ends_the_stuck_request(instant_llm, monkeypatch):
    """A last resort against stalls no rule foresaw: rather than spin, end the head."""
    core = EngineCore(_core(instant_llm).config)  # fresh: no finished ids left to forget
    monkeypatch.setattr(core.scheduler, "_schedule_waiting", lambda step: None)
    req = _request([1, 2, 3])
    results = _run(core, [req])
    assert results[req.request_id].error == (
        ErrorKind.FAILED,
        "the scheduler could not schedule it",
    )
    monkeypatch.undo()
    assert len(_run(core, [_request([1, 2, 3], 2)]).popitem()[1].tokens) == 2


class _CountingQueue(queue.Queue):
    """The core loop's output queue: counts every message the loop sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.sent += 1
        super().put(item, block, timeout)


def _blocked_in_get(thread: threading.Thread) -> bool:
    """Whether `thread` is waiting inside a blocking `Queue.get` (asleep, not polling)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "get" and frame.f_locals.get("block") is True:
            return frame.f_back is not None and frame.f_back.f_code.co_name == "run_busy_loop"
        frame = frame.f_back
    return False


def _busy_loop(core: EngineCore, out_q: queue.Queue, first: list | None = None):
    """The core process's loop alone (no sockets, no I/O threads) on a thread, with
    `first` already in its input queue: (the process object, the thread, the _Stop it
    ended with, once it has)."""
    from asyncllm.engine.core_main import EngineCoreProc, _Stop

    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.in_q, proc.out_q = queue.Queue(), out_q
    for item in first or []:
        proc.in_q.put(item)
    stopped: list[BaseException] = []

    def loop() -> None:
        try:
            proc.run_busy_loop(core)
        except _Stop as e:
            stopped.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return proc, thread, stopped


def test_the_core_loop_goes_to_sleep_after_requests_it_cannot_schedule(instant_llm):
    """The process loop itself (core_main.run_busy_loop) with an empty and a too-long
    request wedged in the scheduler and a good one sent as a message: both bad ones end
    with INVALID errors, the good one with its tokens, and then the loop sleeps in a
    blocking read of its input, having sent nothing more (it used to spin, sending empty
    outputs)."""
    from asyncllm.engine.core_main import _Control
    from asyncllm.messages import EngineCoreOutputs, MsgKind

    core = _core(instant_llm)
    _inject(core, "empty", [])
    _inject(core, "too-long", [5] * 1500)
    ok = _request([1, 2, 3], max_tokens=3)
    proc, thread, stopped = _busy_loop(core, _CountingQueue(), [(MsgKind.ADD, ok)])
    results: dict[str, Result] = {}
    while len([r for r in results.values() if r.finish_reason]) < 3:
        out = proc.out_q.get(timeout=60)
        assert isinstance(out, EngineCoreOutputs) and out.outputs, "an empty output was sent"
        for o in out.outputs:
            r = results.setdefault(o.request_id, Result())
            r.tokens += o.new_token_ids
            r.finish_reason = o.finish_reason or r.finish_reason
            if o.error is not None:
                r.error = (o.error.kind, o.error.message)
    for rid in ("empty", "too-long"):
        assert results[rid].error is not None and results[rid].error[0] is ErrorKind.INVALID
    assert results[ok.request_id].tokens == [1003, 1004, 1005]
    while not _blocked_in_get(thread):  # the condition, not a sleep: it must come
        thread.join(0.01)
        assert thread.is_alive()
    sent = proc.out_q.sent
    assert proc.out_q.empty() and not core.has_unfinished_requests()
    proc.in_q.put(_Control("test over", failed=False))
    thread.join(60)
    assert stopped and not thread.is_alive()
    assert proc.out_q.sent == sent  # nothing was sent while it slept
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("idle_s", [0.0, 3600.0], ids=["trims", "next-work-first"])
def test_the_core_trims_its_heap_only_once_idle_for_a_while(instant_llm, monkeypatch, idle_s):
    """The heap trim (milliseconds; it holds the allocator's locks) waits until no work
    came for TRIM_AFTER_IDLE_S: work that comes back sooner runs without one in front
    of it, and a core left idle trims once."""
    from asyncllm.engine import core_main
    from asyncllm.engine.core_main import _Control

    trims: list[float] = []
    trimmed = threading.Event()

    def trim() -> bool:
        trims.append(time.monotonic())
        trimmed.set()
        return True

    monkeypatch.setattr(core_main, "trim_heap", trim)
    monkeypatch.setattr(core_main, "TRIM_AFTER_IDLE_S", idle_s, raising=False)
    core = _core(instant_llm)
    proc, thread, stopped = _busy_loop(core, queue.Queue())
    for _ in range(2):  # two bursts, the second sent once the first has finished
        req = _request([1, 2, 3], max_tokens=3)
        proc.in_q.put((core_main.MsgKind.ADD, req))
        finished = False
        while not finished:
            finished = any(o.finish_reason for o in proc.out_q.get(timeout=60).outputs)
    if idle_s:
        assert not trims  # (an hour idle has not passed)
    else:
        assert trimmed.wait(60)
    proc.in_q.put(_Control("test over", failed=False))
    thread.join(60)
    assert stopped and not thread.is_alive()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks


# -- the model runner (a tiny random Llama in this process) ----------------------------

VOCAB = 384


TINY_ARGS: dict[str, Any] = dict(
    device="cpu",
    max_model_len=128,
    skip_tokenizer_init=True,
    num_gpu_blocks_override=256,
    logits_processors=["tests.engine.processors:ForceToken"],
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama3", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_core(tiny_folder):
    core = EngineCore(create_engine_config(EngineArgs(model=str(tiny_folder), **TINY_ARGS)))
    yield core
    core.shutdown()


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % VOCAB for i in range(n)]


def _batch(n_good: int = 3) -> list[EngineCoreRequest]:
    return [
        _request(
            _prompt(5 + 3 * i, i), max_tokens=5, temperature=0.9, top_k=20, seed=i, ignore_eos=True
        )
        for i in range(n_good)
    ]


def _check_isolated(
    core: EngineCore, results: dict[str, Result], bad: str, good: list[str], why: str
):
    r = results[bad]
    assert r.finish_reason == "abort" and r.tokens == []
    assert r.error is not None and r.error[0] is ErrorKind.FAILED and why in r.error[1], r.error
    for rid in good:
        assert len(results[rid].tokens) == 5 and results[rid].finish_reason == "length"
        assert results[rid].error is None
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert bad not in core.executor.worker.runner.input_batch.requests  # type: ignore[attr-defined]
    # ... and the engine serves on
    again = _request(_prompt(9, 99), max_tokens=3, temperature=0.0)
    assert len(_run(core, [again])[again.request_id].tokens) == 3


def _run_with_bad(
    core: EngineCore, good: list[EngineCoreRequest], bad: EngineCoreRequest, break_it
):
    """Adds them (the bad one in the middle of the batch), then breaks the bad one past
    every check before the runner: what a changed object or a missed check would do."""
    for r in good[:1] + [bad] + good[1:]:
        core.add_request(r)
    break_it(core.scheduler.requests[bad.request_id])
    return _run(core, [])


def test_an_unrepresentable_top_k_in_the_runner_fails_that_request_alone(tiny_core):
    good, bad = _batch(), _request(_prompt(6, 50), max_tokens=5, temperature=0.8)

    def break_it(req: Request) -> None:
        req.sampling_params.top_k = 2**63

    results = _run_with_bad(tiny_core, good, bad, break_it)
    _check_isolated(tiny_core, results, bad.request_id, [g.request_id for g in good], "top_k")


def test_a_token_id_past_the_vocabulary_in_the_runner_fails_that_request_alone(tiny_core):
    good, bad = _batch(), _request(_prompt(6, 51), max_tokens=5)

    def break_it(req: Request) -> None:
        req.prompt_token_ids[2] = VOCAB + 5  # the embedding lookup would fail the step

    results = _run_with_bad(tiny_core, good, bad, break_it)
    _check_isolated(tiny_core, results, bad.request_id, [g.request_id for g in good], "token id ")


def test_a_logits_processor_refusing_a_request_fails_it_alone(tiny_core):
    """ForceToken does int(extra_args['force_token']): plain data the frontend accepts."""
    good = _batch()
    forced = _request(_prompt(4, 60), max_tokens=5, extra_args={"force_token": 42})
    bad = _request(_prompt(6, 61), max_tokens=5, extra_args={"force_token": "forty-two"})
    results = _run_with_bad(tiny_core, good + [forced], bad, lambda req: None)
    _check_isolated(tiny_core, results, bad.request_id, [g.request_id for g in good], "ValueError")
    assert results[forced.request_id].tokens == [42] * 5


def test_a_value_the_sampling_rows_cannot_hold_fails_only_the_culprit(tiny_core, monkeypatch):
    """Past the runner's own checks too: the request's row of sampling parameters
    cannot be written when it joins, so only it fails."""
    runner = tiny_core.executor.worker.runner
    monkeypatch.setattr(runner, "_check_new_request", lambda new: None)
    good, bad = _batch(), _request(_prompt(6, 70), max_tokens=5, temperature=0.8)

    def break_it(req: Request) -> None:
        req.sampling_params.top_k = 2**63

    results = _run_with_bad(tiny_core, good, bad, break_it)
    _check_isolated(tiny_core, results, bad.request_id, [g.request_id for g in good], "take it")


def test_a_batch_that_cannot_be_sampled_is_sampled_alone(tiny_core, monkeypatch):
    """Sampling the whole batch fails; each request is sampled alone and only the one
    that fails alone is failed."""
    runner = tiny_core.executor.worker.runner
    good, bad = _batch(), _request(_prompt(6, 70), max_tokens=5, temperature=0.8)
    metadata = runner.sampling.metadata

    def fails_with_the_culprit(states, rows, rows_dev, num_pending, extra_counts=None):
        if any(s.req_id == bad.request_id for s in states):
            raise RuntimeError("no tensor for this row")
        return metadata(states, rows, rows_dev, num_pending, extra_counts)

    monkeypatch.setattr(runner.sampling, "metadata", fails_with_the_culprit)
    results = _run_with_bad(tiny_core, good, bad, lambda req: None)
    _check_isolated(tiny_core, results, bad.request_id, [g.request_id for g in good], "sampling")


def test_an_error_no_request_can_be_blamed_for_is_the_engines(tiny_core, monkeypatch):
    runner = tiny_core.executor.worker.runner

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(runner.step_sampler, "sampler", broken)
    for r in _batch(2):
        tiny_core.add_request(r)
    with pytest.raises(RuntimeError, match="the device is gone"):
        tiny_core.step()
    monkeypatch.undo()
    tiny_core.abort_requests(list(tiny_core.scheduler.requests))
    tiny_core.step()


def test_seed_minus_one_draws_differ(tiny_core):
    def draws(seed: int) -> list[list[int]]:
        reqs = [
            _request(_prompt(6, 80), max_tokens=16, temperature=3.0, seed=seed) for _ in range(2)
        ]
        results = _run(tiny_core, reqs)
        return [results[r.request_id].tokens for r in reqs]

    a, b = draws(-1)
    assert a != b  # seed -1 is no seed (it used to seed both alike)
    a, b = draws(12)
    assert a == b


def test_a_request_failed_in_the_runner_raises_request_failed_error_and_the_llm_serves_on(
    tiny_folder,
):
    llm = LLM(model=str(tiny_folder), multiprocess=False, **TINY_ARGS)
    try:
        bad = SamplingParams(max_tokens=3, extra_args={"force_token": "forty-two"})
        with pytest.raises(RequestFailedError, match="forty-two"):
            llm.generate({"prompt_token_ids": _prompt(5, 1)}, bad, use_tqdm=False)
        forced = SamplingParams(max_tokens=3, extra_args={"force_token": 7})
        out = llm.generate({"prompt_token_ids": _prompt(5, 1)}, forced, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == [7, 7, 7]
        assert llm.get_stats()["num_running"] == 0
    finally:
        llm.shutdown()
