"""asyncllm: an asyncio-native, embeddable LLM serving engine."""

from asyncllm.config import EngineArgs
from asyncllm.entrypoints.llm import LLM
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
