"""asyncllm: an asyncio-native, embeddable LLM serving engine."""

from asyncllm.config import EngineArgs

__version__ = "0.1.0"

__all__ = ["EngineArgs", "__version__"]
