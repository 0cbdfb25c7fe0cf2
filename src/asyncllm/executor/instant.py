"""An executor without a model: it answers every step at once with fixed tokens.

For measuring everything around the model (scheduler, wire, frontend, detokenizer):
`distributed_executor_backend="asyncllm.executor.instant:InstantExecutor"`. Each
request's next token is a function of its position, so runs are repeatable.
"""

from __future__ import annotations

from asyncllm.config import EngineConfig
from asyncllm.executor.base import Executor
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput

FIRST_TOKEN = 1000  # ordinary word pieces in SmolLM2's vocabulary


class InstantExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.known: dict[str, int] = {}  # request id -> tokens it has (prompt + output)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        return cache.num_gpu_blocks_override or 1 << 16

    def initialize_cache(self, num_blocks: int) -> None:
        return None

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            self.known[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        out = ModelRunnerOutput(sampled_token_ids={})
        for rid, n in so.num_scheduled_tokens.items():
            if computed[rid] + n >= self.known[rid]:
                out.sampled_token_ids[rid] = [FIRST_TOKEN + self.known[rid] % 500]
                self.known[rid] += 1
        return out
