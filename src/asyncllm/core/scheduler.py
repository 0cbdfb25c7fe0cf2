"""Continuous batching under one token budget per step.

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (one
token for a decode, a chunk for an unfinished prefill), then waiting ones, so prefill
chunks and decodes share a batch. When KV blocks run out, the lowest-priority running
request (FCFS: the latest) is preempted: its blocks are freed and it goes back to the
waiting queue (FCFS: at the front), to be recomputed later (mostly from the prefix
cache); a step that had to preempt admits no waiting request.

`schedule()` is three steps: `_schedule_running` (with preemption), `_schedule_waiting`,
then `_build_output`, which also advances each request's computed tokens and the
statistics. `update_from_output()` appends the sampled tokens, applies the stop rules
and frees the requests that finished.

Async scheduling (the engine schedules step N+1 before step N's results are applied)
rests on output placeholders and on each step's record of its requests: see the
`Scheduler` contract. A request that ended while a step of it was in flight keeps its
blocks (detached from its id) until the last such step is applied; a preempted one's
are freed at once (the device runs steps in order).

A request is never left to block the others: one that can never get a token scheduled
(an empty prompt, a prompt of more than max_model_len tokens, more KV blocks than the
whole pool, a prompt that cannot fit one step without chunked prefill) is ended with an
error output (`take_error_outputs`) when the scheduler meets it, and one the model
runner could not take (`ModelRunnerOutput.failed`) is ended in `update_from_output`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from asyncllm.config import SchedulerConfig, SchedulingPolicy
from asyncllm.core.block_pool import KVCacheBlock
from asyncllm.core.grammar_fill import GrammarFill
from asyncllm.core.kv_cache_coordinator import KVCacheBlocks
from asyncllm.core.kv_cache_manager import KVCacheManager, block_ids
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.request_queue import create_request_queue
from asyncllm.core.spec_decode import Speculation
from asyncllm.core.step_plan import Scheduled, StepPlan
from asyncllm.messages import EngineCoreOutput, ErrorKind, RequestError, SchedulerStats
from asyncllm.step_io import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)

if TYPE_CHECKING:
    from asyncllm.structured.manager import FillJob, StructuredOutputManager


class Scheduler:
    """Owns every unfinished request: `requests` by id, `waiting` (a queue under the
    policy), `running` (in the order their tokens go into each batch), and through
    `grammar` (core/grammar_fill.py) those whose grammars compile.

    The contract with the engine core and the model runner (after vLLM v1's
    `SchedulerInterface`):

    `add_request(req)` queues a request; `finish_requests(ids, status)` ends requests
    from outside (aborts, stop strings found by the frontend).

    `schedule()` returns a `SchedulerOutput`, plain data (step_io.py): the requests the
    runner has not seen (`scheduled_new_reqs`, all of their data: new, or resumed after
    a preemption with their output tokens), what changed for those it holds
    (`scheduled_cached_reqs`: new block ids and computed tokens before the step), the
    tokens each computes this step (`num_scheduled_tokens`, in batch order), the ids it
    must forget (`finished_req_ids`: finished, aborted or preempted since the last
    step), and for constrained requests that sample, their bitmask rows
    (`structured_req_ids`, `grammar_buffer` and, for a device step, `grammar_seq`).
    Every step it returns must be run (or retired with `retire_unlaunched`): each
    scheduled request's `num_computed_tokens` is advanced by its scheduled count at
    schedule time, as if the step had run.

    A step samples for a request when its scheduled tokens reach the end of the
    request's tokens (known ones plus output placeholders). Until that step is
    applied, its sample is an output placeholder (`Request.num_output_placeholders`
    grows by one), so the next step may schedule the decode of a token still in
    flight (async scheduling; the runner feeds it from the device). Not under pipeline
    parallelism (`SchedulerConfig.runner_holds_samples` False), where the first stage
    never holds what the last samples: a request with a token in flight waits until
    that step is applied, and `scheduled_cached_reqs.new_token_ids` gives every rank
    the tokens each held request computes, so the steps in flight at once (one per
    stage) hold different requests.

    `update_from_output(sched, runner_output)` applies the step `sched` once, from the
    record made when it was scheduled: it expects `runner_output.sampled_token_ids`
    to give each request that sampled a list of k >= 1 tokens (an empty list, or no
    entry, for one still in prefill), `logprobs` with one position per token,
    `prompt_logprobs` for the chunk's prompt positions, and `failed` for requests the
    runner could not take. The placeholder is released, then the k tokens are appended
    in order with the stop rules checked after each (eos, stop tokens, max_tokens,
    max_model_len, a grammar's end); the tokens after the first that ends the request
    are dropped. k > 1 is how speculative decoding returns a step's accepted drafts
    plus its own token (core/spec_decode.py): a request with d drafts
    (`scheduled_spec_decode_tokens`) is scheduled 1 + d tokens (its computed tokens
    advanced by 1 + d), gets k <= 1 + d back, and its computed tokens go back by the
    1 + d - k rejected positions. Tokens appended beyond those computed are computed
    by the next step (`_num_new_tokens`). Requests that finished, were aborted or were preempted
    since `sched` get nothing; a request the runner failed is ended, its unwritten
    blocks unregistered from the prefix cache.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # for the runner to forget, next step
        self.stats = SchedulerStats(num_blocks=kv_cache_manager.num_blocks)
        self._error_outputs: list[EngineCoreOutput] = []  # requests ended by `schedule()`
        # Steps scheduled and not yet applied: id(SchedulerOutput) -> (it, its requests).
        self._in_flight: dict[int, tuple[SchedulerOutput, list[Scheduled]]] = {}
        # Structured outputs: grammars compiling, bitmasks to fill, tokens for matchers.
        self.grammar = GrammarFill(structured, self.requests, self._fail_later)
        spec = config.speculative
        self.spec = Speculation(spec, config.max_model_len) if spec is not None else None

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a new request. ValueError if an unfinished request has its id (the id
        of a finished one may be reused)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.spec is not None:
            self.spec.admit(request, len(self.requests))
        if request.sampling_params.structured_outputs is not None:
            self.grammar.add(request)  # queued once its grammar is ready
            self.requests[request.request_id] = request
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside (an abort, or a stop string the frontend found)
        with `status`, which must be a finished one: frees their blocks now and tells
        the runner next step. Returns the requests ended; unknown ids and finished
        requests are skipped. A step already scheduled for them gives them nothing."""
        assert RequestStatus.is_finished(status)
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            ended.append(req)
        running = {id(r) for r in ended if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        self.grammar.forget({id(r) for r in ended})
        self.waiting.remove_many([r for r in ended if id(r) not in running])
        for req in ended:
            req.status = status
            self._free(req)
        return ended

    def _fail(self, req: Request, kind: ErrorKind, reason: str) -> EngineCoreOutput:
        """Ends an unfinished request the core cannot serve (frees its blocks, tells the
        runner next step); its final output, with finish_reason 'abort' and the error."""
        self.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason="abort",
            error=RequestError(kind, reason),
        )

    def _fail_later(self, req: Request, kind: ErrorKind, reason: str) -> None:
        """`_fail`, its output for `take_error_outputs`."""
        self._error_outputs.append(self._fail(req, kind, reason))

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """The outputs of requests `schedule()` ended because they could never be
        scheduled (or whose grammar refused a token), since the last call."""
        out, self._error_outputs = self._error_outputs, []
        return out

    def fail_stalled(self) -> list[EngineCoreOutput]:
        """A last resort, for a step that scheduled nothing, ended nothing and reported
        nothing although requests are unfinished: nothing would change by itself, so
        rather than spin, the request at the head (the first running one, else the
        first waiting one) is ended with an error. Returns its output."""
        head = self.running[0] if self.running else self.waiting.peek() if self.waiting else None
        if head is None:
            return []
        return [self._fail(head, ErrorKind.FAILED, "the scheduler could not schedule it")]

    def retire_unlaunched(
        self, sched: SchedulerOutput, why: str = "its step was interrupted before it ran"
    ) -> list[EngineCoreOutput]:
        """Ends a step that was scheduled but will never run (an error or an interrupt
        before its launch): its requests fail with `why` (their tokens for it rolled
        back, the blocks held for it released), as if the runner had refused them, and
        no step of it stays in flight; the ids it was to tell the runner to forget go
        with the next step. Returns their outputs."""
        self.grammar.drop(sched)
        self.finished_req_ids |= sched.finished_req_ids
        record = self._in_flight.get(id(sched))
        failed = {req.request_id: why for req, *_ in record[1]} if record is not None else {}
        return self.update_from_output(sched, ModelRunnerOutput({}, failed=failed))

    def _unschedulable(self, req: Request, num_computed: int) -> EngineCoreOutput:
        """Ends a request of which no token can ever be computed."""
        max_len = self.config.max_model_len
        if req.num_tokens == 0:
            return self._fail(req, ErrorKind.INVALID, "the prompt is empty")
        if len(req.prompt_token_ids) > max_len or num_computed >= max_len:
            return self._fail(
                req,
                ErrorKind.INVALID,
                f"the prompt has {len(req.prompt_token_ids)} tokens; max_model_len is {max_len}",
            )
        return self._fail(
            req,
            ErrorKind.FAILED,
            f"none of its tokens can be scheduled ({req.num_tokens} tokens, "
            f"{num_computed} computed, max_model_len {max_len})",
        )

    def _free(self, req: Request) -> None:
        """Forgets an ended request (its id may be reused at once) and releases its
        blocks, or holds them while a step of it is still in flight."""
        blocks = self.kv.take_blocks(req)
        if req.num_in_flight:
            req.held_blocks = blocks
        else:
            self.kv.free_blocks(blocks)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        if self.spec is not None:
            self.spec.forget(req)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled whose results `update_from_output` has not applied yet."""
        return len(self._in_flight)

    def sampling_requests(self, sched: SchedulerOutput) -> list[str]:
        """Ids of the requests whose next token the step `sched` (in flight) samples."""
        record = self._in_flight.get(id(sched))
        return [req.request_id for req, _, samples, _ in record[1] if samples] if record else []

    def has_unfinished_requests(self) -> bool:
        """Whether `schedule()` has anyone to schedule (running, waiting, or waiting for
        its grammar)."""
        return bool(self.running) or len(self.waiting) > 0 or bool(self.grammar.compiling)

    @property
    def num_unfinished_requests(self) -> int:
        """Running plus waiting requests."""
        return len(self.running) + len(self.waiting) + len(self.grammar.compiling)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decides the next step: which requests compute how many tokens, within the
        token budget, `max_num_seqs` and the free KV blocks (preempting when blocks run
        out). Each scheduled request's `num_computed_tokens` is advanced now, as if the
        step had run, so the runner must run every step it is given. The output may
        schedule no token (nothing fits) yet still carry ids for the runner to forget.
        """
        if self.grammar.compiling:
            idle = not self.running and not len(self.waiting) and not self._in_flight
            for req in self.grammar.take_compiled(wait=idle):
                self.waiting.add(req)
        step = StepPlan(self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # the pool is short: admitting would only preempt again
            self._schedule_waiting(step)
        return self._build_output(step)

    def _schedule_running(self, step: StepPlan) -> None:
        """Gives each running request, in order, its next tokens (one decode token or the
        next prefill chunk), preempting others when its new tokens do not fit in the
        blocks. Stops when the budget is spent, or when the request being served was
        itself the victim (every other request outranks it, and nothing is free). A
        request that can never get a token (nothing left to compute, or more blocks
        than the whole pool while it runs alone) is ended with an error instead."""
        i = 0
        max_len = self.config.max_model_len
        while i < len(self.running) and step.budget > 0:  # (ending a request replaces the list)
            req = self.running[i]
            pending = req.num_output_placeholders
            if pending and (req.num_verifying or not self.config.runner_holds_samples):
                # (pipeline stages: its next input is the token still in flight; drafts in
                # flight: how many it keeps, so where it goes on, is not known yet)
                i += 1
                continue
            if pending and (
                len(req.output_token_ids) + pending >= req.max_tokens
                or req.num_tokens + pending >= max_len
            ):
                i += 1  # its last token is on its way: nothing more to compute
                continue
            computed = req.num_computed_tokens
            drafts: list[int] = []
            if req.num_tokens + pending - computed == 1 and computed < max_len:
                n = 1  # a decode (what `_num_new_tokens` gives it, with budget left)
                if self.spec is not None:
                    drafts = self.spec.drafts(req, pending, step.budget, len(self.running))
            else:
                n = self._num_new_tokens(req, computed, step.budget)
            if n <= 0:  # with budget left: it never will get a token
                self._error_outputs.append(self._unschedulable(req, req.num_computed_tokens))
                continue  # it left self.running: i is already the next one
            blocks = None
            if drafts:  # (only where they fit as they are: drafts never preempt)
                blocks = self.kv.allocate_slots(req, 1 + len(drafts))
                if blocks is not None:
                    n += len(drafts)
                    step.drafts[req.request_id] = drafts
            if not drafts or blocks is None:
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None and len(self.running) == 1:
                if pending or self._in_flight:
                    # Its token in flight is still due, or blocks are held for a step in
                    # flight (of a request that ended meanwhile): try again after it.
                    i += 1
                    continue
                # Alone, nothing in flight, every other block is free: it needs more
                # than the whole pool.
                self._error_outputs.append(self._too_big_for_the_pool(req))
                continue
            if blocks is None:
                blocks = self._preempt_until_allocated(req, n, step)
                if blocks is None:
                    return
                i = self.running.index(req)  # victims ahead of it moved it forward
            step.add(req, n, req.num_computed_tokens, block_ids(blocks) if blocks else [])
            i += 1

    def _preempt_until_allocated(
        self, req: Request, n: int, step: StepPlan
    ) -> KVCacheBlocks | None:
        """Preempts running requests (see `_preempt_one`) until `n` more tokens of `req`
        fit; returns its new blocks, or None if `req` itself was preempted. A victim
        already given tokens this step gives them back to the budget."""
        while True:
            victim = self._preempt_one()
            step.preempted = True
            step.take_back(victim)
            if victim is req:
                return None
            blocks = self.kv.allocate_slots(req, n)
            if blocks is not None:
                return blocks

    def _preempt_one(self) -> Request:
        """Preempts the lowest-priority running request (priority: the highest value,
        then the latest arrival; FCFS: the last admitted): see `_preempt`."""
        if self.config.policy is SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        self._preempt(victim)
        return victim

    def _recompute_readers(self, blocks: list[KVCacheBlock], rebuild_matchers: bool) -> None:
        """Preempts the running requests holding any of `blocks` (found in the prefix
        cache, but never written: the request that was to write them failed), so they
        compute their tokens again; their results in flight are dropped. Where the step
        being applied gave its tokens to the matchers ahead (`rebuild_matchers`), a
        constrained reader's matcher may hold a token dropped here: it is rebuilt."""
        if not blocks:
            return
        unwritten = {id(b) for b in blocks}
        blocks_from = self.kv.blocks_from
        for req in [
            r for r in self.running if any(id(b) in unwritten for b in blocks_from(r.request_id, 0))
        ]:
            self.running.remove(req)
            self._preempt(req)
            if rebuild_matchers and req.structured is not None:
                self.grammar.rebuild_matcher(req)

    def _preempt(self, victim: Request) -> None:
        """Preempts `victim`, taken out of `running`: its blocks are freed, its progress
        reset, and it waits again, keeping its output tokens."""
        self.kv.free(victim)  # before num_computed_tokens is reset: see KVCacheManager.free
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # a step in flight samples them: dropped
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(victim)
        self.finished_req_ids.add(victim.request_id)  # the runner drops its state

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admits waiting requests in queue order, each starting after its prefix-cache
        hit, while the budget, `max_num_seqs` and the free blocks allow. Stops at the
        first that does not fit rather than skip it, so small requests behind a big one
        cannot starve it; but one that can never fit (an empty prompt, one of more
        than max_model_len tokens, one too big for a step without chunked prefill or
        for the whole pool) is ended with an error, so it cannot block the queue."""
        cfg = self.config
        while step.budget > 0 and len(self.waiting) > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req.num_tokens == 0 or len(req.prompt_token_ids) > cfg.max_model_len:
                self._error_outputs.append(self._unschedulable(req, 0))
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = self._num_new_tokens(req, num_hit, step.budget)
            if n <= 0:  # with budget left: it never will get a token
                self._error_outputs.append(self._unschedulable(req, num_hit))
                continue
            if not cfg.enable_chunked_prefill and num_hit + n < req.num_tokens:
                whole = self._num_new_tokens(req, num_hit, cfg.max_num_batched_tokens)
                if num_hit + whole < req.num_tokens:  # not even a whole step would do
                    self._error_outputs.append(
                        self._fail(
                            req,
                            ErrorKind.INVALID,
                            f"its {req.num_tokens - num_hit} tokens to compute do not fit in "
                            "one step (max_num_batched_tokens, long_prefill_token_threshold) "
                            "and chunked prefill is off",
                        )
                    )
                    continue
                break  # the whole prompt must fit in one step
            if self.kv.allocate_slots(req, n, num_hit, hit_blocks) is None:
                if not self.running and not self._in_flight:  # all blocks free: it never fits
                    self._error_outputs.append(self._too_big_for_the_pool(req))
                    continue
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first admission, not a resumption
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            step.add(req, n, num_hit, None)

    def _too_big_for_the_pool(self, req: Request) -> EngineCoreOutput:
        bs = self.kv.block_size
        return self._fail(
            req,
            ErrorKind.FAILED,
            f"it needs more KV cache blocks ({req.num_tokens} tokens in blocks of {bs}) than "
            f"the {self.kv.num_blocks} there are",
        )

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens `req` may compute this step: the rest of its tokens (known, or being
        sampled by a step in flight), capped by the per-chunk threshold, the budget left
        and max_model_len."""
        n = req.num_tokens + req.num_output_placeholders - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > threshold:
            n = threshold
        return min(n, budget, self.config.max_model_len - num_computed)

    def _build_output(self, step: StepPlan) -> SchedulerOutput:
        """The SchedulerOutput for the plan: full data for newly admitted (or resumed)
        requests, only what changed for the others. Advances each scheduled request's
        `num_computed_tokens`, output placeholders and the step statistics, records the
        step for `update_from_output`, and hands over the ids the runner must forget."""
        new_data, cached = self._runner_data(step)
        num_scheduled = {req.request_id: n for req, n in zip(step.reqs, step.num_tokens)}
        prefill = decode = 0
        chunked = False
        scheduled: list[Scheduled] = []
        structured: list[Request] = []
        lagging = False  # a structured row's matcher has yet to see a token in flight
        drafts = step.drafts
        for req, n, before in zip(step.reqs, step.num_tokens, step.computed_before):
            pending = req.num_output_placeholders
            known = req.num_tokens + pending
            d = len(drafts.get(req.request_id, ())) if drafts else 0
            if n == 1 + d and before == known - 1 and (pending or req.output_token_ids):
                decode += 1
            else:
                prefill += n
                chunked |= before + n < known
            samples = before + n >= known
            scheduled.append((req, before, samples, req.num_preemptions))
            if d:
                req.num_verifying += 1
            req.num_computed_tokens = before + n
            req.num_in_flight += 1
            req.num_output_placeholders = pending + samples
            if samples and req.structured is not None:
                structured.append(req)
                lagging |= pending > 0
        self._record_step(prefill, decode, chunked)
        if drafts:
            self.stats.spec_num_drafts += len(drafts)
            self.stats.spec_num_draft_tokens += sum(map(len, drafts.values()))
        finished, self.finished_req_ids = self.finished_req_ids, set()
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(step.num_tokens),
            finished_req_ids=finished,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            scheduled_spec_decode_tokens=drafts,
        )
        if structured:
            self.grammar.plan_masks(out, structured, lagging)
        if scheduled:
            self._in_flight[id(out)] = (out, scheduled)
        return out

    def _runner_data(self, step: StepPlan) -> tuple[list[NewRequestData], CachedRequestData]:
        """What the runner gets of each request: all of its data for one admitted (or
        resumed after a preemption) this step, only its new blocks and computed tokens
        for one it holds."""
        new_data = []
        cached = CachedRequestData()
        send_tokens = not self.config.runner_holds_samples
        for req, n, before, blocks in zip(
            step.reqs, step.num_tokens, step.computed_before, step.new_block_ids
        ):
            if blocks is None:  # admitted this step
                new_data.append(
                    NewRequestData(
                        req_id=req.request_id,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=list(req.output_token_ids),
                        sampling_params=req.sampling_params,
                        block_ids=self.kv.get_block_ids(req.request_id),
                        num_computed_tokens=before,
                        eos_token_id=req.eos_token_id,
                    )
                )
            else:
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(before)
                if send_tokens:
                    cached.new_token_ids.append(req.all_token_ids[before : before + n])
        return new_data, cached

    # -- structured outputs: the grammar fill (see core/grammar_fill.py) -----------

    def plan_grammar_fill(
        self, sched: SchedulerOutput, ahead: SchedulerOutput | None = None, device: bool = False
    ) -> FillJob | None:
        """Starts the fill of the bitmask `masks_due(sched)` left empty (None: nothing
        to fill). The matchers first accept the tokens kept since the last fill, then
        those `ahead` (the step in flight before `sched`, not yet applied: its update
        then queues none) samples, which `give_grammar_tokens` sends once they are
        known: the grammar process waits for them, so this (and the message's Python)
        runs before they are. A request that ended or was preempted gets an all-allowing
        row (its token is dropped), as does one that a token of `ahead` ends. The job
        runs in the grammar process while the caller goes on; `finish_fill` waits for
        it, before `sched` samples. A `device` fill (the structured manager's
        `device_steps`) gets the tokens of `ahead` from the device, and the device
        waits for its bitmask: `sched.grammar_seq` and `grammar_ahead_req_ids` tell the
        runner how."""
        record = self._in_flight.get(id(ahead)) if ahead is not None else None
        return self.grammar.plan_grammar_fill(
            sched, ahead, record[1] if record is not None else None, device
        )

    def _record_step(self, prefill: int, decode: int, chunked: bool) -> None:
        s = self.stats
        s.step_prefill_tokens, s.step_decode_tokens = prefill, decode
        if not prefill and not decode:  # (nothing to run: not a step of the model)
            return
        s.num_steps += 1
        s.total_prefill_tokens += prefill
        s.total_decode_tokens += decode
        s.num_mixed_steps += bool(prefill and decode)
        s.num_chunked_prefill_steps += chunked

    # -- after the model ran -------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, runner: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies the results of the step `sched` described (once: a step applied
        already, or one that scheduled nothing, gives nothing). Returns one output per
        request that got tokens or prompt logprobs or finished, in batch order;
        finished requests are freed (the runner hears of them next step). Requests that
        ended or were preempted since `sched` was made get nothing, even if a new
        request took the id in the meantime; blocks held for this step are released."""
        sent_ahead = self.grammar.take_accepted_ahead(sched)  # (their matchers have them)
        record = self._in_flight.pop(id(sched), None)
        if record is None:
            return []
        outputs = []
        running, failed = RequestStatus.RUNNING, runner.failed
        drafted = sched.scheduled_spec_decode_tokens
        for req, computed_before, samples, preemptions in record[1]:
            req.num_in_flight -= 1
            if drafted and req.request_id in drafted:
                req.num_verifying -= 1
            if req.status == running and req.num_preemptions == preemptions:
                req.num_output_placeholders -= samples
                reason = failed.get(req.request_id) if failed else None
                if reason is not None:
                    # Its step did not run: the blocks it was to fill hold nothing (and
                    # must not stay findable in the prefix cache), and requests that
                    # found them there since compute their prefix again.
                    unwritten = self.kv.blocks_from(req.request_id, computed_before)
                    req.num_computed_tokens = computed_before
                    outputs.append(self._fail(req, ErrorKind.FAILED, reason))
                    self._recompute_readers(unwritten, rebuild_matchers=bool(sent_ahead))
                else:
                    drafts = sched.scheduled_spec_decode_tokens.get(req.request_id)
                    if drafts is not None:
                        assert self.spec is not None
                        k = len(runner.sampled_token_ids.get(req.request_id, ()))
                        self.spec.verified(req, k, computed_before, len(drafts), self.stats)
                    accept = id(req) not in sent_ahead
                    out = self._update_request(req, runner, accept, computed_before)
                    if drafts and out is not None and out.new_token_ids:
                        # (tokens generated: the step counted its first as a decode)
                        self.stats.total_decode_tokens += len(out.new_token_ids) - 1
                    if out is not None:
                        outputs.append(out)
            if not req.num_in_flight and req.held_blocks is not None:
                self.kv.free_blocks(req.held_blocks)
                req.held_blocks = None
        return outputs

    def _update_request(
        self,
        req: Request,
        runner: ModelRunnerOutput,
        accept: bool = True,
        computed_before: int = 0,
    ) -> EngineCoreOutput | None:
        """Appends the request's k >= 1 sampled tokens of the step in order, checking the
        stop rules after each: the tokens after the first that ends it are dropped (and
        their logprobs). Its output, or None if it has nothing to report. `accept`: its
        matcher is to accept them (False: `plan_grammar_fill` sent them already)."""
        rid = req.request_id
        new_tokens: list[int] = []
        finished = False
        constrained = req.structured is not None
        ends_grammar = self.grammar.stop_token_ids if constrained else ()
        sampled = runner.sampled_token_ids.get(rid, ())
        for token in sampled:
            req.append_token(token)
            new_tokens.append(token)
            if constrained and accept:
                self.grammar.note_kept(req, token)
            if req.check_stop(token, self.config.max_model_len):
                finished = True
                break
            if token in ends_grammar:
                req.status = RequestStatus.FINISHED_STOPPED  # (its grammar is complete)
                finished = True
                break
        prompt_lp = runner.prompt_logprobs.get(rid) if runner.prompt_logprobs else None
        if prompt_lp is not None:  # (positions computed_before on: drop those sent before)
            prompt_lp = req.take_new_prompt_logprobs(prompt_lp, computed_before)
        if not new_tokens and prompt_lp is None and not finished:
            return None  # mid-prefill: nothing to say yet
        logprobs = runner.logprobs.get(rid) if runner.logprobs and new_tokens else None
        if logprobs is not None and len(new_tokens) < len(logprobs.ranks):  # (some dropped)
            k = len(new_tokens)
            logprobs = TokenLogprobs(
                logprobs.token_ids[:k], logprobs.logprobs[:k], logprobs.ranks[:k]
            )
        out = EngineCoreOutput(
            rid,
            new_tokens,
            logprobs,
            prompt_lp,
            RequestStatus.finish_reason(req.status) if finished else None,
            req.stop_reason,
            req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
            None,
            # with the first tokens only: the frontend measures queue time once
            req.first_scheduled_time if len(req.output_token_ids) == len(new_tokens) else 0.0,
        )
        if finished:
            self.running.remove(req)
            self._free(req)
        return out

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the counters (since start, and of the last step) with the
        current queue lengths, KV usage and prefix-cache totals: a copy, so the caller
        may keep or send it while later steps go on."""
        s = self.stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = self.kv.usage()
        s.num_free_blocks = self.kv.num_free_blocks
        s.num_held_blocks_per_group = self.kv.num_held_blocks()
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.stats.queries, self.kv.stats.hits
        return SchedulerStats(**{f: getattr(s, f) for f in s.__struct_fields__})
