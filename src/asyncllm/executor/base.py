"""The executor interface: how the engine core reaches its worker(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from asyncllm.config import EngineConfig
from asyncllm.step_io import GrammarMemory, ModelRunnerOutput, SchedulerOutput


class StepFuture(Protocol):
    """A launched step: `result()` waits for it and returns its output (once). A step
    launched with `grammar_bitmask_later` samples at `finish_launch()`."""

    def result(self) -> ModelRunnerOutput: ...

    def finish_launch(self) -> None: ...


class DoneStep:
    """A step that already ran."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output

    def finish_launch(self) -> None:
        return None


class Executor(ABC):
    # Whether `execute_model_async` takes `grammar_bitmask_later` (queues the forward,
    # samples at the future's `finish_launch`); if not, the bitmask is filled first.
    splits_launch = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Launches the step and returns before its results are known, where the
        executor can (the engine schedules the next step meanwhile); by default it runs
        the step to the end."""
        return DoneStep(self.execute_model(scheduler_output))

    # -- structured outputs: the worker's side of what a SchedulerOutput names by index --

    def attach_grammar_memory(self, memory: GrammarMemory) -> None:  # noqa: B027
        """Hands the worker(s) the structured manager's shared memory, once at start-up:
        steps name their bitmask buffer and handshake by index (`grammar_buffer`,
        `grammar_seq`). The default runs no model and needs none."""

    def wait_bitmask_copied(self, buffer: int) -> None:  # noqa: B027
        """Waits until the copy that read bitmask buffer `buffer` for the last step that
        used it has run (the structured manager writes it again next). The default
        copies nothing asynchronously."""

    def grammar_tokens_given(self, seq: int) -> bool:
        """Whether the worker has queued the device's hand-over of the tokens ahead for
        device step `seq` (then the host must not write them or their flag)."""
        return False

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:  # noqa: B027
        """`callback(error)` is called, from another thread, once the executor has failed
        for good while the engine may be idle (a worker process died): the engine core
        then ends as dead rather than waiting for work. The default never fails so."""

    def startup_seconds(self) -> dict[str, float]:
        """The worker's start-up stages (stage -> seconds), where it measured them."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 (an optional hook)
        """Releases workers; the default has nothing to release."""
