"""The scheduler's rules, one test each, driven by a fake model runner.

The fake runner samples a token that depends only on its position, so every expected
output can be written down, and a request's tokens cannot change with how it was
scheduled (chunked, preempted, resumed from the prefix cache).

The rules:
- each step hands out at most `max_num_batched_tokens` tokens, running requests first
  (a decode is one token, an unfinished prefill a chunk), then waiting ones;
- so decodes and prefill chunks share a step, and a long prompt is split over steps
  (`long_prefill_token_threshold` caps one chunk; without chunked prefill a prompt
  waits until it fits whole); at most `max_num_seqs` requests run;
- when KV blocks run out a running request is preempted (FCFS: the latest one; priority:
  the lowest priority, i.e. highest value): its blocks are freed, it goes back to the
  waiting queue (FCFS: at the front), the runner is told to drop it, and it later comes
  back as a new request carrying its output tokens; a step that preempts admits no
  waiting request;
- a waiting request takes its longest cached prefix in whole blocks, never its last
  token;
- a request stops at max_tokens or max_model_len ("length"), at eos or a stop token
  ("stop"), but not before min_tokens; an abort frees its blocks at once, or once the
  step in flight that writes them has been applied.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from asyncllm.config import SchedulerConfig, SchedulingPolicy
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import BlockHasher
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.messages import EngineCoreOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

from .test_block_pool import assert_pool_invariants

FCFS, PRIORITY = SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY


def token_at(position: int) -> int:
    """The fake model's token for a position: deterministic, never a prompt token."""
    return (position * 7 + 3) % 50 + 10


def run_fake_model(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Samples one token for each request whose scheduled tokens reach the end of its
    known tokens; a request still in prefill gets none."""
    sampled: dict[str, list[int]] = {}
    for rid in out.num_scheduled_tokens:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled[rid] = [token_at(req.num_tokens)] if done else []
    return ModelRunnerOutput(sampled_token_ids=sampled)


_fresh = itertools.count(1000)


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other prompt has, so no accidental prefix-cache hits."""
    return [next(_fresh) for _ in range(n)]


_clock = itertools.count()


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 256,
    enable_caching: bool = True,
    **config: object,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, **config), kv)  # type: ignore[arg-type]


def add(
    scheduler: Scheduler,
    rid: str,
    prompt: int | list[int],
    *,
    max_tokens: int = 16,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival: float | None = None,
    **params: object,
) -> Request:
    """Adds a request; an int prompt means that many fresh tokens. Requests arrive in
    the order they are added unless `arrival` says otherwise."""
    tokens = fresh_tokens(prompt) if isinstance(prompt, int) else prompt
    req = Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id,
        max_tokens,
        arrival_time=float(next(_clock)) if arrival is None else arrival,
        priority=priority,
        block_hasher=BlockHasher(scheduler.kv.block_size),
    )
    scheduler.add_request(req)
    return req


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, run_fake_model(scheduler, out))


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, Result]:
    results: dict[str, Result] = defaultdict(Result)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return dict(results)
        for o in step(scheduler)[1]:
            r = results[o.request_id]
            r.tokens += o.new_token_ids
            r.finish_reason, r.stop_reason = o.finish_reason, o.stop_reason
    pytest.fail(f"requests still unfinished after {max_steps} steps")


# -- the token budget ------------------------------------------------------------------


def test_running_requests_go_first_and_the_rest_of_the_budget_goes_to_waiting_ones() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    add(sched, "a", 40)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 32}
    add(sched, "b", 40)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("a", 8), ("b", 24)]
    assert out.total_num_scheduled_tokens == 32


def test_running_requests_go_first_even_before_higher_priority_waiting_ones() -> None:
    """Admission order follows priority, but a running request is never skipped for a
    waiting one: the budget goes to running requests first."""
    sched = make_scheduler(max_num_batched_tokens=32, policy=PRIORITY)
    add(sched, "low", 40, priority=5)
    step(sched)
    add(sched, "high", 40, priority=0)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("low", 8), ("high", 24)]


def test_decodes_and_prefill_chunks_share_one_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    add(sched, "a", 8)
    step(sched)  # a's whole prompt; its first token is sampled
    add(sched, "b", 100)
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 31}
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 31)
    assert sched.stats.num_mixed_steps == 1
    assert [o.request_id for o in outputs] == ["a"]  # b is mid-prefill: nothing sampled


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    add(sched, "a", 80)
    steps = [step(sched) for _ in range(4)]
    assert [out.num_scheduled_tokens["a"] for out, _ in steps] == [32, 32, 16, 1]
    assert [[t for o in outs for t in o.new_token_ids] for _, outs in steps] == [
        [],
        [],
        [token_at(80)],  # the first token comes with the last chunk
        [token_at(81)],
    ]
    assert sched.stats.num_chunked_prefill_steps == 2  # the steps that left a prompt partial
    assert sched.stats.num_mixed_steps == 0


def test_long_prefill_token_threshold_caps_each_prefill_chunk() -> None:
    """A cap per request, so one long prompt cannot take the whole budget."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    add(sched, "a", 40)
    add(sched, "b", 40)
    chunks = [step(sched)[0].num_scheduled_tokens for _ in range(3)]
    assert chunks == [{"a": 16, "b": 16}, {"a": 16, "b": 16}, {"a": 8, "b": 8}]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    add(sched, "a", 20, max_tokens=2)
    assert step(sched)[0].num_scheduled_tokens == {"a": 20}
    add(sched, "b", 32)
    # a's decode takes 1 token, 31 are left: b would get a 31-token chunk if chunking
    # were on; without it, b waits.
    assert step(sched)[0].num_scheduled_tokens == {"a": 1}
    assert step(sched)[0].num_scheduled_tokens == {"b": 32}  # a finished: the budget is whole


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, 8, max_tokens=2)
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, _ = step(sched)  # a and b decode their second and last token
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"c": 8}


# -- preemption ------------------------------------------------------------------------


def test_fcfs_preemption_takes_the_latest_request_and_resumes_it_with_its_outputs() -> None:
    """4 blocks of 4 tokens. a and b (8 tokens each) take them all; a's next decode
    needs a fifth block, so b, the latest, is preempted: its blocks are freed, it goes
    before c in the waiting queue, and the runner is told to drop it. When it is
    resumed, the runner gets it as a new request whose outputs so far come along, and
    its first block is still in the prefix cache."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a = add(sched, "a", 8, max_tokens=2)
    b = add(sched, "b", 8, max_tokens=3)
    c = add(sched, "c", 4, max_tokens=1)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}  # no block left for c
    b_blocks = sched.kv.get_block_ids("b")[0]

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.stats.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    assert sched.kv.get_block_ids("b") == []
    assert a.is_finished  # a took b's last block for its decode, then hit max_tokens

    out, outputs = step(sched)
    (resumed, _) = out.scheduled_new_reqs
    assert resumed.req_id == "b"
    assert resumed.prompt_token_ids == b.prompt_token_ids
    assert resumed.output_token_ids == [token_at(8)]
    assert resumed.num_computed_tokens == 4  # b's first block survived in the cache
    assert sched.kv.get_block_ids("b")[0][0] == b_blocks[0]
    assert out.num_scheduled_tokens["b"] == 9 - 4
    assert [o.new_token_ids for o in outputs if o.request_id == "b"] == [[token_at(9)]]

    results = run_until_done(sched)
    assert results["b"].tokens == [token_at(10)]
    # Tokens depend only on positions: the preemption changed nothing b produced.
    assert b.output_token_ids == [token_at(8), token_at(9), token_at(10)]


@pytest.mark.parametrize(
    ("policy", "victim", "survivor"), [(FCFS, "high", "low"), (PRIORITY, "low", "high")]
)
def test_the_preemption_victim_is_the_latest_or_the_lowest_priority(
    policy: SchedulingPolicy, victim: str, survivor: str
) -> None:
    """ "low" (priority 5) starts first, "high" (priority 0) joins a step later; in the
    third step high's decode needs a block and none is free. FCFS preempts the latest
    running request (high itself); priority preempts the lowest priority (low), undoing
    the decode it was already given this step."""
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=20, policy=policy)
    add(sched, "low", 8, priority=5)
    step(sched)
    add(sched, "high", 8, priority=0)
    assert step(sched)[0].num_scheduled_tokens == {"low": 1, "high": 8}
    assert sched.kv.num_free_blocks == 0

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {survivor: 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.finished_req_ids == {victim}
    assert [r.request_id for r in sched.running] == [survivor]
    assert [r.request_id for r in sched.waiting] == [victim]


def test_tokens_of_a_victim_preempted_mid_step_go_back_to_the_budget() -> None:
    """Under the priority policy the victim may have been given tokens earlier in the
    same step; they are taken back and later running requests can use them.

    Budget 16, chunks capped at 8, 8 blocks of 4. In step 3 low (priority 5, running
    first) is given 8 tokens and takes the last free blocks; high's decode then needs a
    block, so low is preempted and its 8 tokens return: mid gets a full chunk of 8
    (7 if the budget were not given back)."""
    sched = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_model_len=64,
        policy=PRIORITY,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
    )
    add(sched, "low", 40, priority=5)
    step(sched)
    add(sched, "high", 4, priority=0)
    add(sched, "mid", 40, priority=1)
    assert step(sched)[0].num_scheduled_tokens == {"low": 8, "high": 4, "mid": 4}
    out, _ = step(sched)
    assert out.finished_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1, "mid": 8}


def test_a_step_that_preempts_admits_no_waiting_request() -> None:
    """Even one that would fit in the blocks the victim freed: the pool is short, and
    admitting now would only lead to more preemption.

    5 blocks of 4, priority policy. Step 1: a (4 tokens) and b (12) take 4 blocks. In
    step 2 a's decode takes the last block and b's needs one more, so b, the lowest
    priority, is preempted, freeing 3 blocks; c (priority 0, one block) still waits."""
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=20, policy=PRIORITY)
    add(sched, "a", 4, priority=0)
    add(sched, "b", 12, priority=5)
    assert step(sched)[0].num_scheduled_tokens == {"a": 4, "b": 12}
    add(sched, "c", 3, priority=0)
    out, _ = step(sched)
    assert out.finished_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert sched.kv.num_free_blocks == 3
    assert [r.request_id for r in sched.waiting] == ["c", "b"]
    assert step(sched)[0].num_scheduled_tokens == {"a": 1, "c": 3}


def test_priority_policy_admits_waiting_requests_by_priority_then_arrival() -> None:
    """Lower value first; among equals the earlier arrival time (not the order in which
    add_request was called)."""
    sched = make_scheduler(policy=PRIORITY, max_num_seqs=1)
    for rid, priority, arrival in [("w", 2, 0.0), ("z", 0, 3.0), ("y", 1, 2.0), ("x", 0, 1.0)]:
        add(sched, rid, 4, max_tokens=1, priority=priority, arrival=arrival)
    order = [r.req_id for _ in range(4) for r in step(sched)[0].scheduled_new_reqs]
    assert order == ["x", "z", "y", "w"]


def test_a_priority_victim_keeps_no_cache_entry_for_blocks_its_step_never_computed() -> None:
    """Blocks enter the prefix cache when they are allocated, before the step computes
    them. A priority victim that was already given a prefill chunk in the same step
    loses that chunk: its blocks must leave the cache, or the request (or another with
    the same prefix) would later "hit" blocks that hold no K/V.

    low's 24-token prompt goes in chunks of 8 (blocks of 4); in step 2 low is given
    tokens 16..23 (two new full blocks, registered), then high's decode needs a block
    and low is preempted. Only 16 of low's tokens were ever computed."""
    sched = make_scheduler(
        num_blocks=7,
        block_size=4,
        max_model_len=28,
        policy=PRIORITY,
        long_prefill_token_threshold=8,
    )
    low = add(sched, "low", 24, priority=5)
    step(sched)
    add(sched, "high", 4, priority=0, max_tokens=2)
    assert step(sched)[0].num_scheduled_tokens == {"low": 8, "high": 4}
    out, _ = step(sched)
    assert out.finished_req_ids == {"low"} and out.num_scheduled_tokens == {"high": 1}
    for h in low.block_hashes[4:]:
        assert sched.kv.pool.get_cached_block(h) is None

    out, _ = step(sched)  # high finished: low resumes from the cache
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "low"
    assert resumed.num_computed_tokens == 16


# -- the prefix cache ------------------------------------------------------------------


def test_a_shared_prefix_is_taken_from_the_cache_in_whole_blocks() -> None:
    sched = make_scheduler(block_size=16)
    prefix = fresh_tokens(48)
    add(sched, "a", prefix + fresh_tokens(10))
    step(sched)
    hits_before = sched.make_stats().prefix_cache_hits
    b = add(sched, "b", prefix + fresh_tokens(10))
    out, _ = step(sched)
    (new_b,) = out.scheduled_new_reqs
    assert new_b.num_computed_tokens == 48 and b.num_cached_tokens == 48
    assert out.num_scheduled_tokens["b"] == 58 - 48
    assert sched.make_stats().prefix_cache_hits - hits_before == 48


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    """The last prompt token must run through the model to sample the first output, so
    an identical 48-token prompt hits 32 tokens (whole blocks before the last token)."""
    sched = make_scheduler(block_size=16)
    prompt = fresh_tokens(48)
    add(sched, "a", prompt)
    step(sched)
    add(sched, "b", list(prompt))
    out, _ = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert out.num_scheduled_tokens["b"] == 16


def test_a_request_may_hit_blocks_another_computes_in_the_same_step() -> None:
    """Blocks are cached when allocated: each layer writes a step's K/V before reading
    it, so a request admitted later in the same step can use them."""
    sched = make_scheduler(block_size=16)
    prefix = fresh_tokens(48)
    add(sched, "a", prefix + fresh_tokens(10))
    add(sched, "b", prefix + fresh_tokens(10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 58, "b": 10}
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0, 48]


def test_without_prefix_caching_nothing_is_reused() -> None:
    sched = make_scheduler(block_size=16, enable_caching=False)
    prompt = fresh_tokens(48)
    add(sched, "a", prompt)
    step(sched)
    add(sched, "b", list(prompt))
    assert step(sched)[0].num_scheduled_tokens["b"] == 48


# -- stopping --------------------------------------------------------------------------

T = [token_at(4 + i) for i in range(8)]  # what a 4-token prompt produces: 41, 48, 55, ...


@pytest.mark.parametrize(
    ("params", "eos", "tokens", "finish_reason", "stop_reason"),
    [
        ({"max_tokens": 3}, None, T[:3], "length", None),
        ({"max_tokens": 8}, T[1], T[:2], "stop", None),
        ({"max_tokens": 3, "ignore_eos": True}, T[1], T[:3], "length", None),
        ({"max_tokens": 8, "stop_token_ids": [T[2]]}, None, T[:3], "stop", T[2]),
        ({"max_tokens": 5, "min_tokens": 3}, T[1], T[:5], "length", None),
        (
            {"max_tokens": 8, "min_tokens": 3, "stop_token_ids": [T[0], T[3]]},
            None,
            T[:4],
            "stop",
            T[3],
        ),
        ({"max_tokens": 8, "min_tokens": 2}, T[1], T[:2], "stop", None),
    ],
    ids=[
        "max_tokens-length",
        "eos-stop",
        "ignore_eos",
        "stop_token-stop-with-reason",
        "min_tokens-suppresses-eos",
        "min_tokens-suppresses-stop-token",
        "min_tokens-counts-the-eos-itself",
    ],
)
def test_stop_conditions(
    params: dict[str, object],
    eos: int | None,
    tokens: list[int],
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    sched = make_scheduler()
    add(sched, "a", 4, eos_token_id=eos, **params)  # type: ignore[arg-type]
    result = run_until_done(sched)["a"]
    assert (result.tokens, result.finish_reason, result.stop_reason) == (
        tokens,
        finish_reason,
        stop_reason,
    )
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_reaching_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=7, num_blocks=8, block_size=4)
    add(sched, "a", 4, max_tokens=100)
    result = run_until_done(sched)["a"]
    assert (result.tokens, result.finish_reason) == (T[:3], "length")


# -- outputs ---------------------------------------------------------------------------


def test_outputs_carry_the_cache_hit_and_the_first_scheduling_time_only_once() -> None:
    """first_scheduled_time comes with a request's first tokens only (the frontend
    measures queue time from it); num_cached_tokens with every output."""
    sched = make_scheduler(block_size=16)
    prefix = fresh_tokens(32)
    add(sched, "a", prefix + fresh_tokens(4), max_tokens=1)
    run_until_done(sched)
    b = add(sched, "b", prefix + fresh_tokens(4), max_tokens=2)
    (first,) = step(sched)[1]
    (second,) = step(sched)[1]
    assert first.first_scheduled_time == b.first_scheduled_time > 0
    assert second.first_scheduled_time == 0.0
    assert first.num_cached_tokens == second.num_cached_tokens == 32


def test_prompt_logprobs_are_reported_from_a_step_that_samples_nothing() -> None:
    """A request gets an output when it has tokens, prompt logprobs or a finish; sample
    logprobs go only with sampled tokens."""
    sched = make_scheduler(max_num_batched_tokens=16)
    add(sched, "a", 40, prompt_logprobs=1)
    out = sched.schedule()
    lp = TokenLogprobs([[1]] * 16, [[-0.5]] * 16, [1] * 16)
    runner_out = ModelRunnerOutput(
        sampled_token_ids={"a": []}, logprobs={"a": lp}, prompt_logprobs={"a": lp}
    )
    (o,) = sched.update_from_output(out, runner_out)
    assert (o.new_token_ids, o.new_prompt_logprobs, o.new_logprobs) == ([], lp, None)
    assert o.finish_reason is None


def test_a_request_id_is_refused_while_its_request_is_unfinished() -> None:
    sched = make_scheduler()
    add(sched, "a", 4, max_tokens=1)
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", 4)
    assert run_until_done(sched)["a"].finish_reason == "length"
    add(sched, "a", 4)  # the id of a finished request may be reused
    assert sched.schedule().num_scheduled_tokens == {"a": 4}


# -- aborts ----------------------------------------------------------------------------


def test_an_abort_frees_the_blocks_at_once_and_tells_the_runner_next_step() -> None:
    sched = make_scheduler(block_size=16)
    add(sched, "a", 40)
    add(sched, "b", 40)
    step(sched)
    free_before, held = sched.kv.num_free_blocks, len(sched.kv.get_block_ids("a")[0])
    assert held == 3

    (ended,) = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert ended.request_id == "a" and ended.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == free_before + held
    assert sched.kv.get_block_ids("a") == [] and "a" not in sched.requests
    assert [r.request_id for r in sched.running] == ["b"]

    out, _ = step(sched)
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    assert "a" not in step(sched)[0].finished_req_ids  # told once
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []


def test_aborting_a_waiting_request_removes_it_from_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    add(sched, "a", 8)
    add(sched, "b", 8)
    step(sched)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0 and "b" in step(sched)[0].finished_req_ids


def test_a_request_aborted_while_its_step_runs_gets_no_output() -> None:
    """Outputs of a step go only to requests still running, even when a new request
    already reuses the aborted one's id; the aborted one's blocks come back only once
    the step that writes them has been applied."""
    sched = make_scheduler()
    add(sched, "a", 8)
    out = sched.schedule()
    runner_out = run_fake_model(sched, out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 1  # held for the step
    again = add(sched, "a", 8)
    assert sched.update_from_output(out, runner_out) == []
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert again.output_token_ids == [] and again.status == RequestStatus.WAITING


# -- property test ---------------------------------------------------------------------


@dataclass
class _RunnerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    keys: list[int] = field(default_factory=list)  # keys[p]: a hash of tokens[: p + 1]

    def extend_keys(self) -> None:
        for t in self.tokens[len(self.keys) :]:
            self.keys.append(hash((self.keys[-1] if self.keys else 0, t)))


class FakeModelRunner:
    """A stricter fake runner for the property test. Like a real one it keeps its own
    copy of each request, built only from SchedulerOutputs (so a resumed request must
    bring its output tokens), and it simulates the paged KV cache: writing a position
    stores a key of the whole prefix up to it, and every position a request attends to
    must hold its own prefix's key (so a bad cache hit or a shared block overwritten
    is caught)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.reqs: dict[str, _RunnerRequest] = {}

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, "resumed before the runner dropped it"
            self.reqs[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids[0]),
                new.num_computed_tokens,
            )
        cached = out.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            assert self.reqs[rid].num_computed == num_computed
            if new_blocks:
                self.reqs[rid].block_ids.extend(new_blocks[0])
        # The step writes every scheduled position, then attention reads.
        for rid, n in out.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.extend_keys()
            end = r.num_computed + n
            assert end <= len(r.tokens) and end <= len(r.block_ids) * bs
            for p in range(r.num_computed, end):
                self.kv[r.block_ids[p // bs]][p % bs] = r.keys[p]
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.num_computed += n
            for k in range(-(-r.num_computed // bs)):
                lo, hi = k * bs, min(r.num_computed, (k + 1) * bs)
                assert self.kv[r.block_ids[k]][: hi - lo] == r.keys[lo:hi], (rid, k)
            if r.num_computed == len(r.tokens):
                r.tokens.append(token_at(len(r.tokens)))
                sampled[rid] = [r.tokens[-1]]
            else:
                sampled[rid] = []
        return ModelRunnerOutput(sampled_token_ids=sampled)


@dataclass
class _Spec:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    priority: int


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    enable_caching: bool
    config: SchedulerConfig
    requests: list[_Spec]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.integers(201, 256))
    min_blocks = -(-max_model_len // block_size)  # one request of any length must fit
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(8, 256)),
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 16])),
        policy=draw(st.sampled_from([FCFS, PRIORITY])),
    )
    rng = random.Random(draw(st.integers(0, 2**16)))
    shared = [rng.randrange(4) for _ in range(200)]  # a common prefix, for cache hits
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, 200))
        shared_len = draw(st.integers(0, prompt_len))
        tail = [rng.randrange(4) for _ in range(prompt_len - shared_len)]
        requests.append(
            _Spec(
                rid=f"r{i}",
                prompt=shared[:shared_len] + tail,
                max_tokens=draw(st.integers(1, 40)),
                arrival_step=draw(st.integers(0, 30)),
                priority=draw(st.integers(0, 3)),
            )
        )
    return Workload(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, 2 * min_blocks)),
        enable_caching=draw(st.booleans()),
        config=config,
        requests=requests,
    )


MAX_STEPS = 2000  # generous: the worst workload needs about 550 steps (8 x (25 + 40) + 30)


# The scenario of test_a_priority_victim_keeps_no_cache_entry_for_blocks_its_step_never_
# computed: random workloads reach it rarely (the stale blocks sit at the front of the
# free queue, so almost any allocation evicts them first).
_PRIORITY_VICTIM_WITH_A_CHUNK = Workload(
    block_size=4,
    num_blocks=7,
    enable_caching=True,
    config=SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=28,
        long_prefill_token_threshold=8,
        policy=PRIORITY,
    ),
    requests=[
        _Spec("low", list(range(24)), max_tokens=4, arrival_step=0, priority=5),
        _Spec("high", [90, 91, 92, 93], max_tokens=2, arrival_step=1, priority=0),
    ],
)


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@settings(max_examples=40, deadline=None)
@given(w=workloads())
@example(w=_PRIORITY_VICTIM_WITH_A_CHUNK)
def test_random_workloads_respect_the_limits_finish_and_free_every_block(
    depth: int, w: Workload
) -> None:
    """`depth` 2 is async scheduling: step N+1 is scheduled (and run) before step N's
    results are applied; the outputs must be the same."""
    cfg = w.config
    kv = KVCacheManager(w.num_blocks, w.block_size, cfg.max_model_len, w.enable_caching)
    sched = Scheduler(cfg, kv)
    runner = FakeModelRunner(w.num_blocks, w.block_size)
    pending = sorted(w.requests, key=lambda s: s.arrival_step)
    added: dict[str, Request] = {}
    produced: dict[str, list[int]] = defaultdict(list)
    finish_reasons: dict[str, str] = {}
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for step_no in range(MAX_STEPS):
        while pending and pending[0].arrival_step <= step_no:
            s = pending.pop(0)
            added[s.rid] = Request(
                s.rid,
                s.prompt,
                SamplingParams(max_tokens=s.max_tokens),
                None,
                s.max_tokens,
                arrival_time=step_no + len(added) / 100,
                priority=s.priority,
                block_hasher=BlockHasher(w.block_size),
            )
            sched.add_request(added[s.rid])
        if not pending and not sched.has_unfinished_requests() and not in_flight:
            break
        out = None
        if sched.has_unfinished_requests():
            out = sched.schedule()
            assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
            assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
            assert all(n > 0 for n in out.num_scheduled_tokens.values())
            assert len(sched.running) <= cfg.max_num_seqs
            runner_out = runner(out)
            for rid in out.num_scheduled_tokens:  # the scheduler and the runner agree
                assert sched.requests[rid].num_computed_tokens == runner.reqs[rid].num_computed
            for r in sched.running:  # blocks for exactly the tokens computed, no more
                num_blocks = len(kv.get_block_ids(r.request_id)[0])
                assert num_blocks == -(-r.num_computed_tokens // w.block_size)
            in_flight.append((out, runner_out))
            if len(in_flight) == 2:
                event("two steps in flight")
        if len(in_flight) >= depth or (in_flight and (out is None or out.is_empty)):
            for o in sched.update_from_output(*in_flight.popleft()):
                assert o.request_id not in finish_reasons, "output after the request finished"
                produced[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    finish_reasons[o.request_id] = o.finish_reason
        # Only running requests hold blocks.
        assert set(kv.coordinator.groups[0].req_to_blocks) <= {r.request_id for r in sched.running}
    else:
        pytest.fail(f"{sched.num_unfinished_requests} requests unfinished after {MAX_STEPS} steps")

    if sched.stats.num_preemptions:
        event("preempted")
    if kv.stats.hits:
        event("prefix cache hit")
    for s in w.requests:
        n = min(s.max_tokens, cfg.max_model_len - len(s.prompt))
        # Positions alone decide tokens: preempted or not, the output is the same.
        assert produced[s.rid] == [token_at(p) for p in range(len(s.prompt), len(s.prompt) + n)]
        assert finish_reasons[s.rid] == "length"
    assert_pool_invariants(kv.pool)
    assert kv.num_free_blocks == w.num_blocks
    assert sched.requests == {} and not sched.running


# -- several tokens of one request in one step (the contract speculative decoding needs)


def test_a_step_may_give_a_request_several_tokens_each_checked_for_a_stop() -> None:
    """The runner may return k >= 1 tokens for a request in one step: they are appended
    in order, the stop rules checked after each; the tokens after the first that ends
    the request are dropped, with their logprobs. The tokens appended beyond those
    computed are what the next step computes."""
    sched = make_scheduler()
    a = add(sched, "a", 5, max_tokens=10)
    b = add(sched, "b", 3, max_tokens=10, stop_token_ids=[42])
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    # (a) three tokens, no stop; (b) a stop token in the middle: the last is dropped
    lp = TokenLogprobs([[11], [42], [13]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    runner = ModelRunnerOutput({"a": [11, 12, 13], "b": [11, 42, 13]}, logprobs={"b": lp})
    outs = {o.request_id: o for o in sched.update_from_output(out, runner)}
    assert outs["a"].new_token_ids == [11, 12, 13] and outs["a"].finish_reason is None
    assert a.output_token_ids == [11, 12, 13] and a.num_output_placeholders == 0
    assert outs["b"].new_token_ids == [11, 42]
    assert (outs["b"].finish_reason, outs["b"].stop_reason) == ("stop", 42)
    assert outs["b"].new_logprobs is not None and outs["b"].new_logprobs.ranks == [1, 1]
    assert b.is_finished and "b" not in sched.requests
    # a's prompt was computed; its three new tokens are computed by the next step
    assert a.num_computed_tokens == 5
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.finished_req_ids == {"b"}
    assert a.num_computed_tokens == 8 and a.num_output_placeholders == 1
    # max_tokens cuts a step's tokens too
    outs = sched.update_from_output(out, ModelRunnerOutput({"a": [14] * 9}))
    assert outs[0].new_token_ids == [14] * 7 and outs[0].finish_reason == "length"
    assert len(a.output_token_ids) == 10
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
