"""SamplingParams: how to pick tokens and when to stop, with vLLM's field names.

Every field is checked on creation; a bad value raises ValueError or TypeError naming
the field, so a bad request is rejected before it reaches the engine.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any

_GREEDY_EPS = 1e-5
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request ends


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_values()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.output_kind = RequestOutputKind(self.output_kind)

    def _check_types(self) -> None:
        ints = ("n", "top_k", "min_tokens")
        for name in ints:
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {type(getattr(self, name)).__name__}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise TypeError(f"{name} must be an int or None, got {type(v).__name__}")
        for name in _FLOAT_FIELDS:
            if not _is_num(getattr(self, name)):
                raise TypeError(
                    f"{name} must be a number, got {type(getattr(self, name)).__name__}"
                )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, list | tuple) or not all(
                isinstance(s, str) for s in self.stop
            ):
                raise TypeError("stop must be a str or a list of str")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list | tuple) or not all(
                map(_is_int, self.stop_token_ids)
            ):
                raise TypeError("stop_token_ids must be a list of int")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and _is_num(v) for k, v in self.logit_bias.items()
            ):
                raise TypeError("logit_bias must be a dict of int token id to float")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError("extra_args must be a dict")
        if not isinstance(self.output_kind, RequestOutputKind | int) or isinstance(
            self.output_kind, bool
        ):
            raise TypeError("output_kind must be a RequestOutputKind")

    def _check_values(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in _FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (no limit) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be non-negative, got {v}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain an empty string")
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be non-negative")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 bits")
        if self.logit_bias and any(
            not math.isfinite(v) and v != float("-inf") for v in self.logit_bias.values()
        ):
            raise ValueError("logit_bias values must be finite or -inf")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


__all__ = ["RequestOutputKind", "SamplingParams"]
