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

With speculative decoding a step samples a request at several positions: its next
token and one per draft, each logits row with the request's persistent row. While
`apply` runs over the rows at draft position i, the request's `output_ids` also holds
drafts 0..i-1 (as if they were output), so a processor that reads the history gives
each position what it would give there without drafts; the rows of one position are
passed together, one `apply` call per position.
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


# Per logits row at a draft position: its request's live output ids and the drafts
# before that position (rows not listed are at their request's next token).
DraftPrefixes = dict[int, tuple[list[int], list[int]]]


def apply_processor(
    proc: LogitsProcessor,
    logits: torch.Tensor,
    rows: list[int],
    prefixes: DraftPrefixes | None = None,
) -> torch.Tensor:
    """`proc.apply(logits, rows)`, once per draft position where `prefixes` lists rows at
    draft positions: the rows of position i are applied together while their requests'
    output ids hold the drafts before it (taken off again before returning)."""
    if not prefixes:
        return proc.apply(logits, rows)
    depth = [0] * len(rows)
    for i, (_, before) in prefixes.items():
        depth[i] = len(before)
    out = logits
    for d in sorted(set(depth)):
        picked = [i for i, x in enumerate(depth) if x == d]
        extended = [prefixes[i] for i in picked] if d else []
        for ids, before in extended:
            ids.extend(before)
        try:
            index = torch.tensor(picked, dtype=torch.int64, device=logits.device)
            part = proc.apply(logits.index_select(0, index), [rows[i] for i in picked])
        finally:
            for ids, before in extended:
                del ids[len(ids) - len(before) :]
        out = out.index_copy(0, index, part)
    return out


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
