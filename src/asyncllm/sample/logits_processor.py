"""User logits processors, named by import path in EngineArgs.logits_processors.

A processor is a class; the engine makes one instance at start:

    class MyProcessor(LogitsProcessor):
        def __init__(self, vocab_size: int, device: torch.device): ...
        def is_argmax_invariant(self) -> bool: ...   # True if it can never change argmax
        def add_request(self, row, params, prompt_ids, output_ids): ...
        def remove_request(self, row): ...
        def apply(self, logits, rows) -> logits

`rows[i]` is the persistent-batch row of logits row i; per-request settings come from
`params.extra_args` (plain data: nothing is pickled). `output_ids` is a live list that
grows as the request generates. As in vLLM, processors that can change the argmax see
the logits after logit bias and min_tokens, before the penalties; argmax-invariant ones
see them after temperature and min-p, before top-k/top-p, and only in batches with a
random row (greedy-only batches skip them).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

from asyncllm.sampling_params import SamplingParams


class LogitsProcessor(ABC):
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @abstractmethod
    def is_argmax_invariant(self) -> bool: ...

    def add_request(  # noqa: B027 (an optional hook)
        self, row: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        """A request took `row` of the persistent batch."""

    def remove_request(self, row: int) -> None:  # noqa: B027 (an optional hook)
        """The request at `row` left."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor: ...


def load_logits_processor_class(path: str) -> type[LogitsProcessor]:
    """'package.module:Class' or 'package.module.Class'."""
    if not isinstance(path, str) or not path:
        raise TypeError(f"logits processor must be named by an import path string, got {path!r}")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"logits processor {path!r} is not of the form 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"logits processor {path!r}: cannot import {module_name!r}: {e}") from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(f"logits processor {path!r} is not a LogitsProcessor subclass")
    return cls
