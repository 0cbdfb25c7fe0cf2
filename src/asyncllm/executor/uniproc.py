"""One worker, in the engine core's own process."""

from __future__ import annotations

from asyncllm.config import EngineConfig
from asyncllm.executor.base import Executor, StepFuture
from asyncllm.step_io import GrammarMemory, ModelRunnerOutput, SchedulerOutput
from asyncllm.worker.worker import Worker


class UniProcExecutor(Executor):
    splits_launch = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        return self.worker.execute_model_async(scheduler_output)

    def attach_grammar_memory(self, memory: GrammarMemory) -> None:
        self.worker.runner.grammar.memory = memory

    def wait_bitmask_copied(self, buffer: int) -> None:
        self.worker.runner.grammar.wait_bitmask_copied(buffer)

    def grammar_tokens_given(self, seq: int) -> bool:
        return self.worker.runner.grammar.tokens_given_seq == seq

    def startup_seconds(self) -> dict[str, float]:
        return dict(self.worker.report.seconds)

    def shutdown(self) -> None:
        self.worker.shutdown()
