"""Speculative decoding in the scheduler, with a fake model: drafts from the proposer
scheduled after a request's last token within the budget, max_tokens and
max_model_len; the step's accepted drafts and the model's own token appended; the
rejected positions rolled back; the output that of the same model without drafts;
every block back at the end."""

from __future__ import annotations

from asyncllm.config import SpeculativeConfig
from asyncllm.core.scheduler import Scheduler
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput

from .test_scheduler import add, make_scheduler

PERIOD = [11, 12, 13, 14, 15, 16]


def model_token(tokens: list[int]) -> int:
    """The fake model: continues a cycle of PERIOD, except that after 15 at a position
    divisible by 4 it says 99 (a token the drafts get wrong)."""
    last = tokens[-1]
    if last == 15 and len(tokens) % 4 == 0:
        return 99
    if last in PERIOD:
        return PERIOD[(PERIOD.index(last) + 1) % len(PERIOD)]
    return PERIOD[0]


def run_model(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Samples each request that reaches the end of its tokens: its token, and, for one
    verifying drafts, each draft while the model agrees, then the model's own token."""
    sampled: dict[str, list[int]] = {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        if req.num_computed_tokens - len(drafts) < req.num_tokens:
            sampled[rid] = []  # (mid-prefill)
            continue
        tokens, new = list(req.all_token_ids), []
        for d in [*drafts, None]:
            t = model_token(tokens)
            new.append(t)
            tokens.append(t)
            if t != d:
                break
        sampled[rid] = new
    return ModelRunnerOutput(sampled_token_ids=sampled)


def spec_scheduler(k: int = 4, limit: int = 16, **kw) -> Scheduler:
    spec = SpeculativeConfig(k, 2, 3, disable_by_batch_size=limit)
    return make_scheduler(speculative=spec, **kw)


def run(sched: Scheduler, max_steps: int = 500) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        out = sched.schedule()
        for o in sched.update_from_output(out, run_model(sched, out)):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests still unfinished")


def test_drafts_are_verified_and_the_output_is_the_models() -> None:
    prompts = {"a": PERIOD * 3, "b": [5, 6, 7] + PERIOD * 2, "c": [40, 41, 42, 43]}
    plain = make_scheduler()
    spec = spec_scheduler()
    for s in (plain, spec):
        for rid, p in prompts.items():
            add(s, rid, p, max_tokens=40)
    want, got = run(plain), run(spec)
    assert got == want and all(len(t) == 40 for t in got.values())
    st = spec.stats
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.num_steps < plain.stats.num_steps
    assert st.total_decode_tokens == plain.stats.total_decode_tokens
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


def test_a_step_rolls_back_the_rejected_positions() -> None:
    sched = spec_scheduler(k=4)
    req = add(sched, "a", [1] + PERIOD * 2, max_tokens=30)
    run_step = lambda: sched.update_from_output(out, run_model(sched, out))  # noqa: E731
    out = sched.schedule()  # the prompt
    run_step()
    rejected = 0
    while not req.is_finished:
        before = req.num_computed_tokens
        out = sched.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        assert out.num_scheduled_tokens == {"a": 1 + len(drafts)}
        assert req.num_computed_tokens == before + 1 + len(drafts)
        (o,) = run_step()
        k = len(o.new_token_ids)
        if not req.is_finished:
            assert req.num_computed_tokens == before + k  # (the last new token: next step)
            assert req.num_tokens == req.num_computed_tokens + 1
        rejected += k < 1 + len(drafts)  # (rolled back past the rejected draft)
    assert rejected


def test_drafts_stay_within_the_budget_max_tokens_and_max_model_len() -> None:
    sched = spec_scheduler(k=8, max_num_batched_tokens=4)
    add(sched, "a", PERIOD * 2, max_tokens=6)
    out = sched.schedule()  # (chunked prompt: 12 tokens in 3 steps)
    sched.update_from_output(out, run_model(sched, out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        n = out.num_scheduled_tokens.get("a", 0)
        req = sched.requests["a"]
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        assert n <= 4 and len(drafts) <= 8
        if drafts:  # its output so far, this step's token and the drafts: max_tokens
            assert len(req.output_token_ids) + 1 + len(drafts) <= 6
        sched.update_from_output(out, run_model(sched, out))
    sched = spec_scheduler(k=8, max_model_len=20)
    add(sched, "b", PERIOD * 2, max_tokens=100)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        req = sched.requests["b"]
        assert req.num_computed_tokens <= 19  # (drafts never reach max_model_len)
        outs = sched.update_from_output(out, run_model(sched, out))
    assert outs[-1].finish_reason == "length"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_request_waits_only_while_drafts_of_it_are_in_flight() -> None:
    """Async scheduling: with its last token in flight a request drafts from the tokens
    known (the lookup's first token stands for the one in flight); with drafts in
    flight, where it goes on is not known until they are verified: it waits."""
    plain = make_scheduler()
    sched = spec_scheduler()
    for s in (plain, sched):
        add(s, "a", PERIOD * 2, max_tokens=20)
        add(s, "b", [7, 8, 9], max_tokens=20)
    first = sched.schedule()  # the prompts
    second = sched.schedule()  # both prompts' tokens in flight
    drafts = second.scheduled_spec_decode_tokens
    assert drafts["a"] == PERIOD[1:5]  # (after the 11 it predicts for the token in flight)
    assert second.num_scheduled_tokens == {"a": 5, "b": 1} and "b" not in drafts
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"b": 1}  # (a's drafts are in flight)
    got: dict[str, list[int]] = {}
    for out in (first, second, third):
        for o in sched.update_from_output(out, run_model(sched, out)):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, tokens in run(sched).items():
        got[rid] += tokens
    assert got == run(plain)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_requests_admitted_under_load_never_speculate_and_no_step_at_the_limit_drafts() -> None:
    sched = spec_scheduler(limit=2)
    a = add(sched, "a", PERIOD * 2)
    b = add(sched, "b", PERIOD * 2)
    c = add(sched, "c", PERIOD * 2)
    assert (a.speculates, b.speculates, c.speculates) == (True, True, False)
    a.max_tokens = 40  # (it outlives the others: then it runs alone and drafts)
    drafted_with = set()
    while sched.has_unfinished_requests():
        running = len(sched.running)
        out = sched.schedule()
        if out.scheduled_spec_decode_tokens:
            drafted_with.add(running)
        sched.update_from_output(out, run_model(sched, out))
    assert drafted_with == {1}  # (no drafts while the batch was at the limit)
    d = add(sched, "d", PERIOD * 2)  # (the engine is idle again)
    assert d.speculates


def test_preemption_and_abort_mid_speculation_free_every_block() -> None:
    # a tiny pool: the second request's growth preempts the first
    sched = spec_scheduler(k=4, num_blocks=6, block_size=4, max_model_len=64)
    add(sched, "a", PERIOD * 2, max_tokens=20)
    add(sched, "b", PERIOD * 2, max_tokens=20)
    got = run(sched)
    assert sched.stats.num_preemptions > 0 and sched.stats.spec_num_drafts > 0
    plain = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    add(plain, "a", PERIOD * 2, max_tokens=20)
    add(plain, "b", PERIOD * 2, max_tokens=20)
    assert got == run(plain)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    # an abort while a verifying step is in flight
    add(sched, "c", PERIOD * 3, max_tokens=50)
    out = sched.schedule()
    sched.update_from_output(out, run_model(sched, out))
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens
    from asyncllm.core.request import RequestStatus

    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, run_model_after_abort(out)) == []
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def run_model_after_abort(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({rid: [11, 12] for rid in out.num_scheduled_tokens})


def test_drafts_that_keep_failing_back_off() -> None:
    """A model that never says what the prompt said: every draft is rejected; after each
    failed verification the request drafts nothing for 1, 2, 4, ... steps."""
    sched = spec_scheduler(k=4)
    add(sched, "a", PERIOD * 3, max_tokens=60)
    drafted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        drafted.append(len(drafts))
        req = sched.requests["a"]
        tokens = [t + 1 for t in drafts[:1]] or [77]  # (never the first draft)
        done = req.num_computed_tokens - len(drafts) >= req.num_tokens
        sched.update_from_output(out, ModelRunnerOutput({"a": tokens if done else []}))
    verified = [i for i, d in enumerate(drafted) if d]
    gaps = [b - a - 1 for a, b in zip(verified, verified[1:])]
    assert len(gaps) >= 4 and all(g >= 2**i for i, g in enumerate(gaps[:4])), gaps
    assert all(d == 1 for d in drafted[verified[1] :] if d)  # (one draft while failing)
    assert sched.stats.spec_num_accepted_tokens == 0
