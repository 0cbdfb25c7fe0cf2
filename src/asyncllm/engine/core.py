"""EngineCore: the scheduler, the KV cache manager and the executor, stepped together."""

from __future__ import annotations

import logging

from asyncllm.config import EngineConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import make_block_hasher
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.executor.base import Executor
from asyncllm.executor.selector import get_executor_class
from asyncllm.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorKind,
    RequestError,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or get_executor_class(config))(config)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(self.num_blocks)
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            cache.block_size,
            config.model.max_model_len,
            cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self._block_hasher = (
            make_block_hasher(cache.block_size) if cache.enable_prefix_caching else None
        )
        self._pending_outputs: list[EngineCoreOutput] = []

    def add_request(self, req: EngineCoreRequest) -> None:
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
            max_tokens=req.max_tokens,
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
        return self.scheduler.has_unfinished_requests()

    def has_pending_outputs(self) -> bool:
        """Outputs that wait for the next step although nothing runs (aborts, refusals)."""
        return bool(self._pending_outputs)

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.scheduler.has_unfinished_requests():
            sched = self.scheduler.schedule()
            if not sched.is_empty or sched.finished_req_ids:
                runner_out = self.executor.execute_model(sched)
                outputs.extend(self.scheduler.update_from_output(sched, runner_out))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats())

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
