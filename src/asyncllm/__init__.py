"""asyncllm: an asyncio-native, embeddable LLM serving engine.

`AsyncLLM` and `LLM` are imported on first use, so that `import asyncllm` (and the
torch-free parts: the scheduler, the KV cache manager, the wire types) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.config import EngineArgs
from asyncllm.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStartupError,
    RequestFailedError,
)
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from asyncllm.entrypoints.async_llm import AsyncLLM
    from asyncllm.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineStartupError",
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestFailedError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "AsyncLLM":
        from asyncllm.entrypoints.async_llm import AsyncLLM

        return AsyncLLM
    if name == "LLM":
        from asyncllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")
