"""The executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from asyncllm.config import EngineConfig
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 (an optional hook)
        """Releases workers; the default has nothing to release."""
