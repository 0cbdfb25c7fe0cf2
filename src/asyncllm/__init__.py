"""asyncllm: an asyncio-native, embeddable LLM serving engine."""

from asyncllm.config import EngineArgs
from asyncllm.entrypoints.async_llm import AsyncLLM
from asyncllm.entrypoints.llm import LLM
from asyncllm.errors import EngineDeadError, EngineOverloadedError, EngineStartupError
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

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
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
