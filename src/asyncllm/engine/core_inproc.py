"""InprocClient: the engine core in the caller's process (`LLM(multiprocess=False)`,
tests, debugging). The one path on which the host side loads the core side (torch, the
model): `LLM` imports this module only when asked for it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from asyncllm.config import EngineArgs
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_config import create_engine_config, resolved_config
from asyncllm.engine.host_client import EngineCoreClient
from asyncllm.errors import EngineDeadError
from asyncllm.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


@contextlib.contextmanager
def _dead_on_worker_failure() -> Iterator[None]:
    """A worker that died or stalled (the multiprocess and Ray executors) ends the engine
    for good: EngineDeadError, as from an engine-core process."""
    from asyncllm.executor.multiproc import StepTimeoutError
    from asyncllm.executor.worker_handles import WorkerDiedError

    try:
        yield
    except (WorkerDiedError, StepTimeoutError) as e:
        raise EngineDeadError(f"the engine's workers failed: {e}") from e


class InprocClient(EngineCoreClient):
    """The engine core in this process: `get_output` runs one step."""

    def __init__(self, args: EngineArgs) -> None:
        self.core = EngineCore(create_engine_config(args))
        self.config = resolved_config(self.core.config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        with _dead_on_worker_failure():
            return self.core.step()

    def settle(self) -> None:
        with _dead_on_worker_failure():
            self.core.apply_steps_in_flight()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
