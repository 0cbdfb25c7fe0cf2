"""EngineCore: the scheduler, the KV cache manager and the executor, stepped together.

With async scheduling (`async_scheduling=True`, the default) up to two steps are in
flight: each `step()` schedules and launches the next step, then waits for the oldest
one and applies its results, so the host schedules and prepares step N+1 (and sends
step N's outputs) while the device runs it. Without it, each `step()` schedules, runs and
applies one step. Under pipeline parallelism up to `pipeline_parallel_size` steps are in
flight (each stage runs a different one), holding different requests (see `Scheduler`).
"""

from __future__ import annotations

import logging
import math
from collections import deque

import torch

from asyncllm.config import EngineConfig
from asyncllm.core.grammar_fill import structured_rows
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import BlockHasher
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.engine.cpu_threads import set_cpu_threads
from asyncllm.envs import grammar_device_steps
from asyncllm.executor.base import Executor, StepFuture
from asyncllm.executor.selector import get_executor_class
from asyncllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorKind,
    RequestError,
    SchedulerStats,
)
from asyncllm.model.kv_groups import engine_kv_cache_layout
from asyncllm.request_checks import check_params_for_model, check_prompt_token_ids
from asyncllm.sampling_params import INT64_MAX, INT64_MIN
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput
from asyncllm.structured.grammar import check as check_structured
from asyncllm.structured.manager import FillJob, StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.thread_tuner = set_cpu_threads(config)
        self.executor = (executor_class or get_executor_class(config))(config)
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()  # (its workers, if it has any, go with it)
            raise
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            cache.block_size,
            config.model.max_model_len,
            cache.enable_prefix_caching,
            engine_kv_cache_layout(config),
        )
        vocab_size = getattr(config.model.hf_config, "vocab_size", None)
        self.vocab_size: int | None = int(vocab_size) if vocab_size is not None else None
        self.structured = StructuredOutputManager(
            None if config.skip_tokenizer_init else config.model.tokenizer,
            self.vocab_size or 0,
            pin_memory=config.model.device.type == "cuda",
            max_rows=structured_rows(config.scheduler),
        )
        # The worker finds the bitmask and the handshake's memory that each step names by
        # index; the manager waits for the worker's copy before it reuses a buffer.
        self.executor.attach_grammar_memory(self.structured.memory())
        self.structured.wait_bitmask_copied = self.executor.wait_bitmask_copied
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.structured)
        self._block_hasher = BlockHasher(cache.block_size) if cache.enable_prefix_caching else None
        self._pending_outputs: list[EngineCoreOutput] = []
        # Steps in flight at once: two with async scheduling, and one per pipeline stage
        # (the batch queue: each stage runs its own step).
        self._depth = max(
            2 if config.scheduler.async_scheduling else 1, config.parallel.pipeline_parallel_size
        )
        self._in_flight: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        # The step launched last while its grammar fill runs (see `_finish_fill`).
        self._filling: tuple[StepFuture, FillJob | None] | None = None
        self._device_steps: bool | None = None  # (known at the first fill that needs it)

    def _check_request(self, req: EngineCoreRequest) -> int:
        """The engine's admission check, run once per request (a request may also come
        straight through the socket): what needs the engine (model length, vocabulary,
        logprob limits, whether its structured-output constraint can be enforced) and
        the wire fields; `SamplingParams.verify()` for the rest. ValueError or TypeError
        naming the problem (the core's process answers it with an INVALID error for that
        request); returns max_tokens, capped by the room the prompt leaves."""
        if not isinstance(req.request_id, str) or not req.request_id:
            raise TypeError("request_id must be a non-empty str")
        ids = req.prompt_token_ids
        max_len = self.config.model.max_model_len
        check_prompt_token_ids(ids, self.vocab_size, max_len)
        params = req.sampling_params
        check_params_for_model(params, self.vocab_size, self.config.max_logprobs)
        eos = req.eos_token_id
        if eos is not None and (type(eos) is not int or eos < 0):
            raise ValueError(f"eos_token_id must be None or a non-negative int, got {eos!r}")
        if req.max_tokens is not None and (type(req.max_tokens) is not int or req.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or at least 1, got {req.max_tokens!r}")
        if params.structured_outputs is not None:
            check_structured(params.structured_outputs)  # (cached by the constraint)
        if type(req.priority) is not int or not INT64_MIN <= req.priority <= INT64_MAX:
            raise ValueError(f"priority must be an int64, got {req.priority!r}")
        if not isinstance(req.arrival_time, int | float) or not math.isfinite(req.arrival_time):
            raise ValueError(f"arrival_time must be a finite number, got {req.arrival_time!r}")
        # (a prompt of max_model_len tokens still gets the token its prefill samples)
        room = max(1, max_len - len(ids))
        return room if req.max_tokens is None else min(req.max_tokens, room)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queues a request. ValueError or TypeError if it is malformed (see
        `_check_request`) or its id is in use by an unfinished request."""
        max_tokens = self._check_request(req)
        limit = self.config.scheduler.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            self._pending_outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[],
                    finish_reason="abort",
                    error=RequestError(
                        ErrorKind.OVERLOADED,
                        f"{limit} requests are already waiting (max_waiting_requests)",
                    ),
                )
            )
            return
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            max_tokens=max_tokens,
            arrival_time=req.arrival_time,
            priority=req.priority,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Ends requests; each gets a final output with finish_reason 'abort'."""
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._pending_outputs.append(
                EngineCoreOutput(request_id=req.request_id, new_token_ids=[], finish_reason="abort")
            )

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, or steps in flight whose results are still to come."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def has_pending_outputs(self) -> bool:
        """Outputs that wait for the next step although nothing runs (aborts, refusals)."""
        return bool(self._pending_outputs)

    def step(self) -> EngineCoreOutputs:
        """One step: the outputs waiting since the last one, the requests the scheduler
        ended (error outputs), and what the model produced. Never a step that changes
        nothing while requests are unfinished: a core loop that steps while
        `has_unfinished_requests()` would spin, sending empty outputs."""
        if self.thread_tuner is not None:
            self.thread_tuner.tick()
        outputs, self._pending_outputs = self._pending_outputs, []
        try:
            return self._step(outputs)
        except BaseException:  # (what this call gathered waits for the next one)
            self._pending_outputs[:0] = outputs
            raise

    def _step(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        launched = applied = False
        # Launch steps until `_depth` are in flight (or nothing more can be scheduled),
        # then apply the oldest: each call ends with one step's results. A step whose
        # grammar masks need the tokens in flight is the last launched by this call: its
        # fill is sent to the grammar process as soon as it is scheduled, and runs there
        # once the last step's tokens are in.
        # - A device step (CUDA, `_uses_device_steps`) launches at once: the device
        #   hands the grammar process those tokens and waits for the masks itself. Then
        #   the answer of the device step before is read and the last step applied.
        # - Otherwise the fill in flight is waited for first, then the last step's tokens
        #   follow the fill (from the host); the step launches and the last step is
        #   applied. Where the launch splits, the fill also runs while this call returns
        #   and the next one schedules; the step samples once it is done (`_finish_fill`).
        while self.scheduler.has_unfinished_requests() and len(self._in_flight) < self._depth:
            sched = self.scheduler.schedule()
            outputs.extend(self.scheduler.take_error_outputs())
            try:
                launched_now, applied_now, last = self._launch(sched, outputs)
            except BaseException:
                # (an error or an interrupt before it was in flight: the scheduler
                # retires it, its requests failed, their blocks for it released)
                if not any(s is sched for s, _ in self._in_flight):
                    outputs.extend(self.scheduler.retire_unlaunched(sched))
                raise
            launched |= launched_now
            applied |= applied_now
            if last:
                break
        if self._in_flight and not applied:
            outputs.extend(self._apply_oldest())
            applied = True
        # (requests a fill's answer ended after `schedule()`: a refused token, a lost
        # grammar process; the next schedule may never come)
        outputs.extend(self.scheduler.take_error_outputs())
        if (
            not launched
            and not applied
            and not outputs
            and self.scheduler.has_unfinished_requests()
        ):
            # Nothing scheduled, ended or reported: the next step would be the same.
            logger.warning("the scheduler made no progress; ending the request at its head")
            outputs.extend(self.scheduler.fail_stalled())
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats())

    def _launch(
        self, sched: SchedulerOutput, outputs: list[EngineCoreOutput]
    ) -> tuple[bool, bool, bool]:
        """Launches the step `sched` (`step`'s loop): whether it launched, whether a step
        was applied meanwhile, and whether it is the last this call launches."""
        masks_due = not sched.is_empty and self.scheduler.grammar.masks_due(sched)
        device = masks_due and self._uses_device_steps()
        job = ahead = last = None
        applied = False
        try:
            if masks_due:
                applied |= self._apply_all_but(1, outputs)
                last = self._in_flight[-1][0] if self._in_flight else None
                job = self.scheduler.plan_grammar_fill(sched, last, device)
            if device:
                future = self.executor.execute_model_async(sched)
            else:
                self._finish_fill()
                ahead = self._tokens_ahead(job) if masks_due else None
        except BaseException:
            # (the grammar process waits for the job's tokens: it gets none, and the
            # next step can be sent; unless the device's hand-over is queued)
            if not sched.grammar_seq or not self.executor.grammar_tokens_given(sched.grammar_seq):
                given = job is not None and job.tokens_sent  # (interrupted just after)
                self.scheduler.grammar.give_grammar_tokens(job, None)
                if last is not None and not given and any(s is last for s, _ in self._in_flight):
                    # (the step ahead stays in flight, its tokens not given to the fill:
                    # its matchers accept them when it is applied)
                    self.scheduler.grammar.accept_when_applied(last)
            raise
        if device:
            self._in_flight.append((sched, future))
            self._finish_fill()
            self._filling = (future, job)
            if len(self._in_flight) > 1:
                applied |= self._apply_ahead(self._tokens_ahead(None), outputs)
            return True, applied, True
        if sched.is_empty:
            if sched.finished_req_ids:  # only ids for the runner to forget
                self.executor.execute_model(sched)
            return False, applied, True
        split = masks_due and self.executor.splits_launch
        try:
            if masks_due and not split:  # (the step ahead is applied while the fill runs)
                applied |= self._apply_ahead(ahead, outputs)
                if job is not None:
                    self.scheduler.grammar.finish_fill(job)
            sched.grammar_bitmask_later = split
            future = self.executor.execute_model_async(sched)
            self._in_flight.append((sched, future))
        except BaseException:  # (the step ahead, out of flight: its results are kept)
            if ahead is not None:
                outputs.extend(self.scheduler.update_from_output(*ahead))
            raise
        if split:  # its forward and fill run while the step before is applied
            self._filling = (future, job)
            applied |= self._apply_ahead(ahead, outputs)
        return True, applied, masks_due

    def apply_steps_in_flight(self) -> None:
        """Waits for every step in flight and applies it; their outputs wait for the next
        `step()`."""
        while self._in_flight:
            self._pending_outputs.extend(self._apply_oldest())
        self._pending_outputs.extend(self.scheduler.take_error_outputs())

    def _uses_device_steps(self) -> bool:
        """Whether constrained steps are device steps (see `step`): the runner is in this
        process, on CUDA, and the device can wait for the grammar's flags."""
        if self._device_steps is None:
            self._device_steps = (
                self.executor.splits_launch
                and self.config.model.device.type == "cuda"
                and grammar_device_steps()
                and self.structured.device_steps
            )
        return self._device_steps

    def _finish_fill(self) -> None:
        """Waits for the grammar fill of the step launched last, if one is running, and
        queues that step's sampling. Before anything else reaches the executor or a
        matcher: the runner would sample that step with the masks half filled."""
        if self._filling is not None:
            future, job = self._filling
            self._filling = None
            try:
                if job is not None:
                    self.scheduler.grammar.finish_fill(job)
            finally:
                future.finish_launch()

    def _tokens_ahead(
        self, job: FillJob | None
    ) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Takes the step in flight (at most one is left) out of flight, waits for its
        tokens and gives them to `job`, whose fill then runs; that step with its runner
        output (None: none was in flight), which `_apply_ahead` applies next."""
        if not self._in_flight:
            return None
        before, before_future = self._in_flight[0]
        ahead = (before, before_future.result())
        self.scheduler.grammar.give_grammar_tokens(job, ahead[1])
        self._in_flight.popleft()  # (only now: interrupted before, it stays in flight)
        return ahead

    def _apply_ahead(
        self, ahead: tuple[SchedulerOutput, ModelRunnerOutput] | None, outputs: list
    ) -> bool:
        """Applies the step `_tokens_ahead` took out of flight; whether there was one."""
        if ahead is None:
            return False
        outputs.extend(self.scheduler.update_from_output(*ahead))
        return True

    def _apply_all_but(self, keep: int, outputs: list) -> bool:
        """Applies the steps in flight but the last `keep`; whether any was applied."""
        applied = False
        while len(self._in_flight) > keep:
            outputs.extend(self._apply_oldest())
            applied = True
        return applied

    def _apply_oldest(self) -> list[EngineCoreOutput]:
        self._finish_fill()
        sched, future = self._in_flight[0]
        output = future.result()
        self._in_flight.popleft()  # (only now: interrupted in the wait, it stays in flight)
        return self.scheduler.update_from_output(sched, output)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.cpu_threads = torch.get_num_threads()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self._filling = None  # (the manager's shutdown lets its thread end the fill)
        self.structured.shutdown()
        self.executor.shutdown()
