"""The executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

import importlib
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


def get_executor_class(config: EngineConfig) -> type[Executor]:
    from asyncllm.executor.uniproc import UniProcExecutor

    backend = config.parallel.distributed_executor_backend
    if backend in (None, "uni"):
        return UniProcExecutor
    module_name, _, attr = (backend or "").partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"distributed_executor_backend {backend!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"distributed_executor_backend {backend!r} is not an Executor subclass")
    return cls
