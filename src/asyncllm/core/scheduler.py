"""Continuous batching under one token budget per step.

Each step hands out at most `max_num_batched_tokens` tokens: running requests first (one
token for a decode, a chunk for an unfinished prefill), then waiting ones, so prefill
chunks and decodes share a batch. When KV blocks run out, the lowest-priority running
request (FCFS: the latest) is preempted: its blocks are freed and it goes back to the
front of the waiting queue, to be recomputed later (mostly from the prefix cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.outputs import EngineCoreOutput, SchedulerStats
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.request_queue import SchedulingPolicy, create_request_queue
from asyncllm.step_io import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one prefill's chunk
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_waiting_requests: int | None = None  # beyond this, new requests are refused


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.stats = SchedulerStats(num_blocks=kv_cache_manager.num_blocks)

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside (abort, or a stop string the frontend found)."""
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
        self.waiting.remove_many([r for r in ended if id(r) not in running])
        for req in ended:
            req.status = status
            self._free(req)
        return ended

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- one step ------------------------------------------------------------------

    def _preempt_one(self) -> Request:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(victim)
        self.finished_req_ids.add(victim.request_id)  # the runner drops its state
        return victim

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        computed_before: dict[str, int] = {}
        preempted_now: set[str] = set()
        new_reqs: list[Request] = []

        # 1. Running requests, in order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req, n)
                if blocks is not None:
                    break
                idx_before = {id(r): k for k, r in enumerate(self.running)}
                victim = self._preempt_one()
                preempted_now.add(victim.request_id)
                if victim.request_id in num_scheduled:  # scheduled earlier this step: undo
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    computed_before.pop(victim.request_id, None)
                if idx_before[id(victim)] < i:
                    i -= 1
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req itself was preempted: nothing left to free for it
            num_scheduled[req.request_id] = n
            new_blocks[req.request_id] = [b.block_id for b in blocks]
            computed_before[req.request_id] = req.num_computed_tokens
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step already had to preempt.
        while not preempted_now and budget > 0 and len(self.waiting) > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = self._num_new_tokens(req, num_hit, budget)
            if n <= 0:
                break
            if not cfg.enable_chunked_prefill and num_hit + n < req.num_tokens:
                break  # the whole prompt must fit in one step
            blocks = self.kv.allocate_slots(req, n, num_hit, hit_blocks)
            if blocks is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            new_reqs.append(req)
            num_scheduled[req.request_id] = n
            computed_before[req.request_id] = num_hit
            budget -= n

        return self._make_output(num_scheduled, new_blocks, computed_before, new_reqs)

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        if (
            self.config.long_prefill_token_threshold
            and n > self.config.long_prefill_token_threshold
        ):
            n = self.config.long_prefill_token_threshold
        n = min(n, budget, self.config.max_model_len - num_computed)
        return n

    def _make_output(self, num_scheduled, new_blocks, computed_before, new_reqs) -> SchedulerOutput:
        new_ids = {r.request_id for r in new_reqs}
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=self.kv.get_block_ids(r.request_id),
                num_computed_tokens=computed_before[r.request_id],
                eos_token_id=r.eos_token_id,
            )
            for r in new_reqs
        ]
        cached = CachedRequestData()
        prefill = decode = 0
        chunked = False
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            before = computed_before[rid]
            if rid not in new_ids:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(new_blocks.get(rid, []))
                cached.num_computed_tokens.append(before)
            if n == 1 and req.num_output_tokens > 0 and before == req.num_tokens - 1:
                decode += 1
            else:
                prefill += n
                chunked |= before + n < req.num_tokens
            req.num_computed_tokens = before + n
        # Requests that will need a fresh state in the runner were dropped there.
        finished = self.finished_req_ids
        self.finished_req_ids = set()
        s = self.stats
        s.num_steps += 1
        s.step_prefill_tokens, s.step_decode_tokens = prefill, decode
        s.total_prefill_tokens += prefill
        s.total_decode_tokens += decode
        s.num_mixed_steps += bool(prefill and decode)
        s.num_chunked_prefill_steps += chunked
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
        )

    # -- after the model ran -------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, runner: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        requests, sampled_ids = self.requests, runner.sampled_token_ids
        running = RequestStatus.RUNNING
        for rid in sched.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None or req.status != running:
                continue  # aborted or preempted while the step ran
            new_tokens: list[int] = []
            for token in sampled_ids.get(rid, ()):
                req.append_output_token_ids(token)
                new_tokens.append(token)
                if self._check_stop(req):
                    break
            prompt_lp = runner.prompt_logprobs.get(rid) if runner.prompt_logprobs else None
            finished = req.status != running
            if not new_tokens and prompt_lp is None and not finished:
                continue
            outputs.append(
                EngineCoreOutput(
                    rid,
                    new_tokens,
                    runner.logprobs.get(rid) if runner.logprobs and new_tokens else None,
                    prompt_lp,
                    RequestStatus.finish_reason(req.status) if finished else None,
                    req.stop_reason,
                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                    None,
                    req.first_scheduled_time if req.num_output_tokens == len(new_tokens) else 0.0,
                )
            )
            if finished:
                self.running.remove(req)
                self._free(req)
        return outputs

    def _check_stop(self, req: Request) -> bool:
        token = req.output_token_ids[-1]
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def make_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = self.kv.usage()
        s.num_free_blocks = self.kv.num_free_blocks
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.stats.queries, self.kv.stats.hits
        return SchedulerStats(**{f: getattr(s, f) for f in s.__struct_fields__})
