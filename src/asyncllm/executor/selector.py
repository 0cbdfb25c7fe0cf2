"""Which executor an engine uses: the in-process one, or an Executor subclass named by
`distributed_executor_backend="module:Class"`."""

from __future__ import annotations

import importlib

from asyncllm.config import EngineConfig
from asyncllm.executor.base import Executor
from asyncllm.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
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
