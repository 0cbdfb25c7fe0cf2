"""Which executor an engine uses: "uni" (the in-process one), "mp" (one worker process
per rank), "ray" (one Ray actor per rank, on any node of a Ray cluster), or an Executor
subclass named by `distributed_executor_backend="module:Class"`. None picks "uni" at
world size 1 and "mp" above (the engine's configuration resolves it first: see
`engine/core_config.py`)."""

from __future__ import annotations

import importlib

from asyncllm.config import EngineConfig
from asyncllm.executor.base import Executor
from asyncllm.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    parallel = config.parallel
    backend = parallel.distributed_executor_backend
    if backend is None:
        backend = "uni" if parallel.world_size == 1 else "mp"
    if backend == "uni":
        if parallel.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank, not {parallel.world_size}"
            )
        return UniProcExecutor
    if backend == "mp":
        from asyncllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from asyncllm.executor.ray_distributed import RayDistributedExecutor

        return RayDistributedExecutor
    module_name, _, attr = backend.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"distributed_executor_backend {backend!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ValueError(f"distributed_executor_backend {backend!r} is not an Executor subclass")
    return cls
