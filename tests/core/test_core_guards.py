"""The scheduler never stalls on a request it cannot serve.

A request that reaches the core malformed (through the socket, past the frontend), one
that can never get a token scheduled, and one the model runner could not take are each
ended with an error output (finish_reason 'abort', a RequestError saying why), their
blocks freed, while the requests around them go on. Driven by the fake runner of
test_scheduler.
"""

from __future__ import annotations

from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.messages import EngineCoreOutput, ErrorKind
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import ModelRunnerOutput

from .test_block_pool import assert_pool_invariants
from .test_scheduler import add, fresh_tokens, make_scheduler, run_fake_model


def _add_raw(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    """A request as a socket could bring it: nothing checked."""
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), None, max_tokens)
    sched.add_request(req)
    return req


def _drive(sched: Scheduler, max_steps: int = 200) -> dict[str, list[EngineCoreOutput]]:
    """Steps until nothing is unfinished, as EngineCore does (error outputs included);
    every step must report something: a step with nothing to say is a stall."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        got = sched.take_error_outputs()
        if out.num_scheduled_tokens or out.finished_req_ids:
            got += sched.update_from_output(out, run_fake_model(sched, out))
        assert got or out.num_scheduled_tokens, "a step that did nothing: the scheduler stalls"
        for o in got:
            outputs.setdefault(o.request_id, []).append(o)
    raise AssertionError(f"still unfinished after {max_steps} steps: {sched.requests}")


def _error(outs: list[EngineCoreOutput]) -> tuple[ErrorKind, str]:
    last = outs[-1]
    assert last.finish_reason == "abort" and last.error is not None, last
    return last.error.kind, last.error.message


def _tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_an_empty_prompt_at_the_head_fails_and_the_queue_moves_on() -> None:
    sched = make_scheduler()
    _add_raw(sched, "empty", [])
    add(sched, "ok", 8, max_tokens=3)
    outs = _drive(sched)
    assert _error(outs["empty"]) == (ErrorKind.INVALID, "the prompt is empty")
    assert len(_tokens(outs["ok"])) == 3 and outs["ok"][-1].finish_reason == "length"


def test_a_prompt_longer_than_max_model_len_fails_without_running_and_one_of_exactly_it_runs() -> (
    None
):
    """As in vLLM: a prompt of exactly max_model_len tokens is accepted and gets the one
    token its prefill samples ("length"); one token more is refused."""
    sched = make_scheduler(max_model_len=64, num_blocks=16, block_size=16)
    _add_raw(sched, "long", fresh_tokens(65))
    _add_raw(sched, "exact", fresh_tokens(64))
    add(sched, "ok", 8, max_tokens=2)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"exact": 64, "ok": 8}
    outs = {o.request_id: [o] for o in sched.take_error_outputs()}
    kind, message = _error(outs["long"])
    assert kind is ErrorKind.INVALID and "max_model_len is 64" in message
    for o in sched.update_from_output(first, run_fake_model(sched, first)):
        outs.setdefault(o.request_id, []).append(o)
    for rid, more in _drive(sched).items():
        outs.setdefault(rid, []).extend(more)
    assert outs["exact"][-1].finish_reason == "length"
    assert len(_tokens(outs["exact"])) == 1 and len(_tokens(outs["ok"])) == 2
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_running_request_with_nothing_left_to_schedule_fails_instead_of_being_skipped() -> None:
    """A runner that returns no token for a request whose step reached the end of its
    tokens leaves it with nothing to compute: it used to be skipped every step."""
    sched = make_scheduler()
    add(sched, "stuck", 8)
    add(sched, "ok", 8, max_tokens=3)
    out = sched.schedule()
    runner_out = run_fake_model(sched, out)
    runner_out.sampled_token_ids["stuck"] = []
    sched.update_from_output(out, runner_out)
    outs = _drive(sched)
    kind, message = _error(outs["stuck"])
    assert kind is ErrorKind.FAILED and "none of its tokens can be scheduled" in message
    assert len(_tokens(outs["ok"])) == 2  # (its first token came from the step above)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_waiting_request_larger_than_the_whole_pool_fails() -> None:
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=256)
    _add_raw(sched, "huge", fresh_tokens(100))  # 7 blocks; the pool has 4
    add(sched, "ok", 8, max_tokens=3)
    outs = _drive(sched)
    kind, message = _error(outs["huge"])
    assert kind is ErrorKind.FAILED and "the 4 there are" in message
    assert len(_tokens(outs["ok"])) == 3
    assert_pool_invariants(sched.kv.pool)


def test_a_request_that_outgrows_the_whole_pool_fails_instead_of_preempting_itself() -> None:
    """Alone, with every other block free, a request that cannot get one more block never
    will: it used to preempt itself and come back forever (recomputing without prefix
    caching) or wait forever."""
    for caching in (True, False):
        sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64, enable_caching=caching)
        add(sched, "grows", 6, max_tokens=20)  # 8 slots: its 3rd token fills them, no 4th fits
        outs = _drive(sched)
        kind, message = _error(outs["grows"])
        assert kind is ErrorKind.FAILED and "the 2 there are" in message
        assert len(_tokens(outs["grows"])) == 3  # its tokens until then went out
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        assert sched.stats.num_preemptions == 0


def test_without_chunked_prefill_a_prompt_that_can_never_fit_one_step_fails() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=64, enable_chunked_prefill=False, long_prefill_token_threshold=16
    )
    add(sched, "long", 40, max_tokens=2)
    add(sched, "ok", 8, max_tokens=2)
    outs = _drive(sched)
    kind, message = _error(outs["long"])
    assert kind is ErrorKind.INVALID and "chunked prefill is off" in message
    assert len(_tokens(outs["ok"])) == 2


def test_a_request_the_runner_could_not_take_fails_alone_and_leaves_no_cache_entry() -> None:
    """The runner dropped it before its step ran: its blocks hold nothing, so none of them
    may be found by a later request with the same prompt."""
    sched = make_scheduler(block_size=4)
    prompt = fresh_tokens(12)
    add(sched, "bad", prompt, max_tokens=2)
    add(sched, "ok", 8, max_tokens=2)
    out = sched.schedule()
    runner_out = run_fake_model(sched, out)
    del runner_out.sampled_token_ids["bad"]
    runner_out.failed["bad"] = "top_k is out of range"
    outs = sched.update_from_output(out, runner_out)
    (bad,) = [o for o in outs if o.request_id == "bad"]
    assert _error([bad]) == (ErrorKind.FAILED, "top_k is out of range")
    assert "bad" not in sched.requests and [r.request_id for r in sched.running] == ["ok"]
    assert not [o for o in sched.update_from_output(out, runner_out) if o.request_id == "bad"]
    again = add(sched, "again", prompt, max_tokens=2)
    nxt = sched.schedule()
    assert "bad" in nxt.finished_req_ids  # the runner hears of it (it dropped it already)
    assert again.num_cached_tokens == 0  # nothing of "bad" was ever computed


def test_the_runner_failing_a_request_aborted_meanwhile_reports_nothing() -> None:
    sched = make_scheduler()
    add(sched, "a", 8)
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    failed = ModelRunnerOutput(sampled_token_ids={}, failed={"a": "bad"})
    assert sched.update_from_output(out, failed) == []
