"""Async scheduling (step N+1 scheduled and launched before step N's tokens are known)
gives the same outputs as one step at a time, on the CPU runner with a tiny random
Llama in float32: greedy, seeded sampling with penalties, stop tokens, min_tokens,
max_tokens, logprobs, a logits processor that reads the output ids, preemption and
aborts; tokens past a stop never reach an output, and every block comes back."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from asyncllm.engine.core import EngineCore
from asyncllm.messages import EngineCoreOutput, EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from tests.model.tiny import make_tiny_model, tiny_engine_core

VOCAB = 384
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-async")
    make_tiny_model("llama3", folder)
    return folder


def _core(folder, async_scheduling: bool, **extra: Any) -> EngineCore:
    return tiny_engine_core(folder, block_size=4, async_scheduling=async_scheduling, **extra)


def _request(
    rid: str, prompt: list[int], max_tokens: int, eos: int | None = None, **params: Any
) -> EngineCoreRequest:
    params.setdefault("ignore_eos", eos is None)
    params.setdefault("temperature", 0.0)  # greedy unless told (seeded otherwise)
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos,
        max_tokens=max_tokens,
        arrival_time=time.monotonic(),
    )


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + 11 * j) % VOCAB for j in range(n)]


def _run(
    core: EngineCore, reqs: list[EngineCoreRequest], abort_after: dict[str, int] | None = None
):
    """Runs to the end; returns each request's outputs. `abort_after[rid] = k` aborts it
    once it has k tokens."""
    outs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    for _ in range(2000):
        if not core.has_unfinished_requests() and not core.has_pending_outputs():
            break
        for o in core.step().outputs:
            assert not any(p.finish_reason for p in outs[o.request_id]), "output after the end"
            outs[o.request_id].append(o)
            n = sum(len(p.new_token_ids) for p in outs[o.request_id])
            if abort_after and abort_after.get(o.request_id) == n and not o.finish_reason:
                core.abort_requests([o.request_id])
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks  # every block back
    assert core.scheduler.num_steps_in_flight == 0
    return outs


def _summary(outs: dict[str, list[EngineCoreOutput]]) -> dict[str, tuple]:
    def one(os: list[EngineCoreOutput]) -> tuple:
        tokens = [t for o in os for t in o.new_token_ids]
        lps = [o.new_logprobs for o in os if o.new_logprobs is not None]
        return tokens, os[-1].finish_reason, os[-1].stop_reason, lps

    return {rid: one(os) for rid, os in outs.items()}


def _both(folder, make_reqs, **extra: Any) -> tuple[dict, dict]:
    results = []
    for flag in (False, True):
        core = _core(folder, flag, **extra)
        try:
            results.append(_summary(_run(core, make_reqs())))
        finally:
            core.shutdown()
    return results[0], results[1]


def _mixed_workload() -> list[EngineCoreRequest]:
    reqs = []
    for i in range(7):
        extra: dict[str, Any] = {}
        if i % 3 == 1:
            extra = dict(temperature=0.8, seed=100 + i, top_k=40, repetition_penalty=1.2)
        elif i % 3 == 2:
            extra = dict(temperature=0.7, seed=200 + i, presence_penalty=0.5, frequency_penalty=0.3)
        if i == 3:
            extra["logprobs"] = 3
        reqs.append(_request(f"m{i}", _prompt(i, 3 + 5 * i), 4 + 3 * i, **extra))
    return reqs


def test_greedy_seeded_penalties_and_logprobs_match(tiny_folder):
    sync, asyn = _both(tiny_folder, _mixed_workload)
    assert asyn == sync
    assert any(s[3] for s in sync.values())  # logprobs were compared


def test_tokens_past_a_stop_never_come_out(tiny_folder):
    """Stop tokens (picked from the free run's output, so they do occur), EOS held back
    by min_tokens, and max_tokens of 1 and 2: step N+1 already ran for these requests
    when step N's stop was seen; its tokens are dropped."""
    core = _core(tiny_folder, False)
    free = _summary(_run(core, [_request(f"f{i}", _prompt(i, 9), 12) for i in range(4)]))
    core.shutdown()
    seqs = [free[f"f{i}"][0] for i in range(4)]

    def reqs() -> list[EngineCoreRequest]:
        return [
            _request("stop", _prompt(0, 9), 12, stop_token_ids=[seqs[0][4]]),
            _request("eos", _prompt(1, 9), 12, eos=seqs[1][1]),
            _request("min", _prompt(2, 9), 12, eos=seqs[2][0], min_tokens=3),
            _request("one", _prompt(3, 9), 1),
            _request("two", _prompt(3, 9), 2),
        ]

    sync, asyn = _both(tiny_folder, reqs)
    assert asyn == sync
    assert sync["stop"][0] == seqs[0][: seqs[0].index(seqs[0][4]) + 1]
    assert sync["stop"][1:3] == ("stop", seqs[0][4])
    assert sync["eos"][0] == seqs[1][: seqs[1].index(seqs[1][1]) + 1]
    assert len(sync["min"][0]) >= 3 and sync["min"][1] in ("stop", "length")
    assert [len(sync["one"][0]), len(sync["two"][0])] == [1, 2]


def test_a_logits_processor_sees_every_earlier_token(tiny_folder):
    def reqs() -> list[EngineCoreRequest]:
        return [
            _request(f"n{i}", _prompt(i, 5 + i), 10, extra_args={"no_repeat": True})
            for i in range(3)
        ]

    sync, asyn = _both(tiny_folder, reqs, logits_processors=["tests.engine.processors:NoRepeat"])
    assert asyn == sync
    for tokens, *_ in sync.values():
        assert all(a != b for a, b in zip(tokens, tokens[1:]))


def test_preemption_while_a_step_is_in_flight(tiny_folder):
    """A pool too small for every request at once: requests are preempted (with a step
    of theirs in flight, under async) and resumed; same tokens, every block back."""

    def reqs() -> list[EngineCoreRequest]:
        return [_request(f"p{i}", _prompt(i, 20 + 3 * i), 24) for i in range(6)]

    sync, asyn = _both(tiny_folder, reqs, num_gpu_blocks_override=40)
    assert asyn == sync
    core = _core(tiny_folder, True, num_gpu_blocks_override=40)
    _run(core, reqs())
    assert core.scheduler.stats.num_preemptions > 0
    core.shutdown()


def test_an_abort_with_a_step_in_flight_holds_its_blocks_until_the_step_ends(tiny_folder):
    core = _core(tiny_folder, True)
    req = _request("a", _prompt(0, 10), 50)
    core.add_request(req)
    core.step()  # launches the prefill and the first decode; applies the prefill
    core.step()  # launches the second decode; applies the first
    assert core.scheduler.num_steps_in_flight == 1
    held = core.num_blocks - core.kv_cache_manager.num_free_blocks
    assert held > 0
    core.abort_requests(["a"])
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - held  # still held
    (aborted,) = core.step().outputs  # the step in flight ends: its token is dropped
    assert (aborted.new_token_ids, aborted.finish_reason) == ([], "abort")
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    again = _request("a", _prompt(1, 10), 3)
    outs = _run(core, [again])
    assert [o.finish_reason for o in outs["a"] if o.finish_reason][-1] == "length"
    assert sum(len(o.new_token_ids) for o in outs["a"]) == 3
    core.shutdown()


def test_aborts_mid_stream_match(tiny_folder):
    def reqs() -> list[EngineCoreRequest]:
        return [_request(f"x{i}", _prompt(i, 7), 20) for i in range(4)]

    results = []
    for flag in (False, True):
        core = _core(tiny_folder, flag)
        outs = _run(core, reqs(), abort_after={"x1": 3, "x2": 1})
        results.append({rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()})
        core.shutdown()
    sync, asyn = results
    assert len(sync["x0"]) == len(sync["x3"]) == 20
    # The abort lands while the next step is in flight: its token is dropped.
    for rid, k in (("x1", 3), ("x2", 1)):
        assert sync[rid] == asyn[rid] == sync[rid][:k]
    assert sync["x0"] == asyn["x0"] and sync["x3"] == asyn["x3"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_go_out_once_through_preemptions_in_chunked_prefill(
    tiny_folder, async_scheduling
):
    """A request preempted part-way through a chunked prefill that asked for prompt
    logprobs computes them again from its first position on resuming: each position is
    sent once, and equal to an uncontended run's."""
    tight = dict(num_gpu_blocks_override=12, long_prefill_token_threshold=4)
    tight.update(max_num_batched_tokens=16, max_model_len=48)
    reqs = [
        _request("A", _prompt(1, 8), 30),
        _request("B", _prompt(2, 36), 4, prompt_logprobs=1),
    ]
    runs = {}
    for name, extra in (("tight", tight), ("roomy", {})):
        core = _core(tiny_folder, async_scheduling, **extra)
        try:
            outs = _run(core, reqs)
            runs[name] = [
                lp for o in outs["B"] if o.new_prompt_logprobs for lp in o.new_prompt_logprobs.ranks
            ]
            if name == "tight":
                assert core.scheduler.stats.num_preemptions > 0
        finally:
            core.shutdown()
    assert len(runs["tight"]) == 35 and runs["tight"] == runs["roomy"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_the_runner_refuses_leaves_no_unwritten_block_to_its_prefix_readers(
    tiny_folder, async_scheduling
):
    """A refused by the runner (a logits processor rejects its arguments) after B,
    with the same prompt, was given A's blocks as a prefix-cache hit: those blocks were
    never written, so B computes its prefix again and its tokens equal B's alone."""
    prompt = _prompt(5, 13)
    processors = dict(logits_processors=["tests.engine.processors:ForceToken"])
    bad = _request("A", prompt, 8, extra_args={"force_token": "oops"})
    runs = {}
    for name, reqs in (
        ("alone", [_request("B", prompt, 8)]),
        ("after", [bad, _request("B", prompt, 8)]),
    ):
        core = _core(tiny_folder, async_scheduling, **processors)
        try:
            outs = _run(core, reqs)
            assert core.kv_cache_manager.num_free_blocks == core.num_blocks
        finally:
            core.shutdown()
        runs[name] = [t for o in outs["B"] for t in o.new_token_ids]
        if name == "after":
            assert outs["A"][-1].error is not None
    assert len(runs["alone"]) == 8 and runs["after"] == runs["alone"]


def test_a_processor_that_fails_to_forget_a_row_leaves_the_others_clean(tiny_folder):
    """A user processor raises on forgetting a row: the others still forget it (a
    forced token does not pass to the row's next request) and the steps go on."""
    processors = ["tests.engine.processors:ForgetsBadly", "tests.engine.processors:ForceToken"]
    core = _core(tiny_folder, False, logits_processors=processors)
    try:
        forced = _run(core, [_request("forced", _prompt(3, 6), 3, extra_args={"force_token": 7})])
        assert [t for o in forced["forced"] for t in o.new_token_ids] == [7, 7, 7]
        plain = [_request(f"plain{i}", _prompt(4, 6), 3) for i in range(2)]
        outs = {rid: _run(core, [r])[rid] for r in plain for rid in [r.request_id]}
    finally:
        core.shutdown()
    ref_core = _core(tiny_folder, False)
    try:
        ref = [
            t
            for o in _run(ref_core, [_request("ref", _prompt(4, 6), 3)])["ref"]
            for t in o.new_token_ids
        ]
    finally:
        ref_core.shutdown()
    for rid, got in outs.items():
        assert got[-1].error is None, got[-1].error
        assert [t for o in got for t in o.new_token_ids] == ref, rid


def test_a_batch_sampled_again_row_by_row_starts_from_the_models_logits(tiny_folder):
    """One request's processor raises: the batch is sampled again row by row, from the
    logits as the model gave them (not as the failed attempt left them, boosted once
    already): the other request's tokens and raw logprobs equal those of a run beside a
    neighbour that does not fail (the same batch)."""
    processors = ["tests.engine.processors:BoostInPlace"]
    boosted = dict(extra_args={"boost": 11}, logprobs=2, max_tokens=4)
    runs = {}
    for name, args in (("calm", {}), ("failing", {"boom": True})):
        core = _core(tiny_folder, False, logits_processors=processors)
        try:
            mine = _request("mine", _prompt(5, 5), **boosted)
            outs = _run(core, [mine, _request("other", _prompt(6, 5), 4, extra_args=args)])
        finally:
            core.shutdown()
        runs[name] = [(o.new_token_ids, o.new_logprobs) for o in outs["mine"]]
        assert (outs["other"][-1].error is not None) == bool(args)
    assert runs["failing"] == runs["calm"]
