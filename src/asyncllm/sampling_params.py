"""SamplingParams: how to pick tokens and when to stop, with vLLM's field names.

Every field is checked on creation (and again by `verify()`, which the frontend and the
engine core call, so an object changed after creation is caught too); a bad value raises
ValueError or TypeError naming the field, so a bad request is rejected before it reaches
the engine. Every number is bounded: integers fit the engine's int64 (token ids and
top-k counts int32) and floats are finite and fit float32, so nothing overflows where
the model runner turns them into tensors or the wire encodes them.
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
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
MAX_TOKEN_ID = 2**31 - 1  # token ids, top_k and logprob counts: far above any vocabulary
MAX_N = 2**16  # completions per request
FLOAT32_MAX = 3.4028234663852886e38
_MAX_EXTRA_ARGS_DEPTH = 32


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request ends


_OUTPUT_KINDS = frozenset(k.value for k in RequestOutputKind)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _show(v: Any) -> str:
    """`v` for an error message; a huge int is abbreviated (str() of one past 4300
    digits would itself raise)."""
    if _is_int(v) and abs(v).bit_length() > 100:
        return f"an int of {abs(v).bit_length()} bits"
    return repr(v)


def _as_float(name: str, x: int | float) -> float:
    """`x` as a float that fits float32 (the dtype the sampler uses); ValueError naming
    `name` if it is not finite or too large."""
    try:
        f = float(x)
    except OverflowError:
        raise ValueError(f"{name} is out of range, got {_show(x)}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {_show(x)}")
    if abs(f) > FLOAT32_MAX:
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:g} in magnitude, got {_show(x)}")
    return f


def _check_range(name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {_show(v)}")


def _check_plain(value: Any, path: str, depth: int = 0) -> None:
    """`value` is plain data msgpack carries unchanged: str, int (64-bit), float, bool,
    None, and lists or str-keyed dicts of those."""
    if depth > _MAX_EXTRA_ARGS_DEPTH:
        raise ValueError(f"{path} nests deeper than {_MAX_EXTRA_ARGS_DEPTH} levels")
    if value is None or isinstance(value, str | bool | float):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= UINT64_MAX:
            raise ValueError(f"{path} is an int outside 64 bits: {_show(value)}")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path} has a key that is not a str: {k!r}")
            _check_plain(item, f"{path}[{k!r}]", depth + 1)
        return
    raise TypeError(
        f"{path} must hold only str, int, float, bool, None, lists and dicts, "
        f"found {type(value).__name__}"
    )


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a formal language (vLLM's names): exactly one of
    json, regex, choice, grammar or json_object. Enforced by xgrammar: each step, the
    tokens that cannot continue a valid output are masked before sampling."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text): the output is one JSON value valid for
    it."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar whose `root` rule the output matches."""
    json_object: bool = False
    """The output is any JSON object."""
    disable_any_whitespace: bool = True
    """JSON without free whitespace between tokens (vLLM's `disable_any_whitespace`), so a
    small model cannot loop on blanks; False allows it."""

    def verify(self) -> None:
        set_ = [
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_ or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise TypeError(
                f"structured_outputs.json must be a dict or a str, got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"structured_outputs.{name} must be a non-empty str")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise TypeError("structured_outputs.choice must be a non-empty list of non-empty str")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool")


@dataclass
class SamplingParams:
    n: int = 1
    """Completions per prompt (each its own sequence, sharing the prompt's KV blocks), in
    [1, 65536]."""
    temperature: float = 1.0
    """Divides the logits before sampling: higher is more random. 0 (or below 1e-5):
    greedy, the most likely token every step. Finite, non-negative."""
    top_p: float = 1.0
    """Nucleus sampling: draw only from the smallest set of tokens whose probabilities add
    up to top_p. In (0, 1]; 1 keeps every token."""
    top_k: int = 0
    """Draw only from the k most likely tokens. 0 or -1: no limit; otherwise in
    [1, 2**31 - 1] (values past the vocabulary keep it all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's. In
    [0, 1]; 0 keeps every token."""
    seed: int | None = None
    """Seeds this request's draws: the same seed, prompt and params give the same
    tokens, whatever else is in the batch. None or -1 (as in vLLM, -1 means unseeded and
    becomes None): drawn from the engine's generator, so requests differ. Otherwise in
    [-2**63, 2**64 - 1] (what torch.Generator.manual_seed accepts). With n > 1, child i
    gets seed + i."""
    max_tokens: int | None = 16
    """The most tokens to generate, in [1, 2**63 - 1]; None: up to max_model_len. Capped
    by the room the prompt leaves (finish reason 'length')."""
    min_tokens: int = 0
    """Tokens to generate before eos and stop tokens may end the request, in
    [0, max_tokens]."""
    stop: str | list[str] | None = None
    """Strings that end the request when they appear in the output text (finish reason
    'stop', stop_reason the string); the string itself is left out of the text unless
    include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request when sampled (kept in the output ids), in
    [0, 2**31 - 1] (the frontend checks them against the vocabulary)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (for benchmarks: every request runs
    to max_tokens)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output: above 0, new
    tokens are favoured. In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it appears in the output: above 0,
    repetition is discouraged. In [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or the
    output: above 1, repetition is discouraged; 1 does nothing. Positive, finite."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given tokens before sampling: token id in
    [0, 2**31 - 1] -> a finite bias (or -inf: never that token)."""
    logprobs: int | None = None
    """Log-probabilities to return per sampled token: the sampled one plus this many of
    the most likely; None: none. In [0, 2**31 - 1] (and at most max_logprobs)."""
    prompt_logprobs: int | None = None
    """Log-probabilities to return per prompt token (the token plus this many of the most
    likely); None: none. In [0, 2**31 - 1] (and at most max_logprobs)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each streamed output holds: CUMULATIVE (everything so far), DELTA (only what
    is new since the last output) or FINAL_ONLY (one output, at the end)."""
    skip_special_tokens: bool = True
    """Leave special tokens (eos, chat markers) out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of the text."""
    extra_args: dict[str, Any] | None = None
    """Per-request arguments for logits processors: str keys, plain data values (str,
    int, float, bool, None, lists and str-keyed dicts of those), since it crosses the
    wire as msgpack."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrains the output to a JSON schema, a regex, a choice or a grammar (see
    StructuredOutputsParams)."""

    def __post_init__(self) -> None:
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None  # vLLM's convention: -1 means unseeded
        self.verify()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.output_kind = RequestOutputKind(self.output_kind)

    def verify(self) -> None:
        """Checks every field (types, then values); ValueError or TypeError naming the
        field. Run on creation; run it again on an object that may have been changed
        since."""
        self._check_types()
        self._check_values()

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
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise TypeError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
            _check_plain(self.extra_args, "extra_args")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        if not isinstance(self.output_kind, int) or isinstance(self.output_kind, bool):
            raise TypeError(
                f"output_kind must be a RequestOutputKind, got {type(self.output_kind).__name__}"
            )

    def _check_values(self) -> None:
        _check_range("n", self.n, 1, MAX_N)
        for name in _FLOAT_FIELDS:
            _as_float(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOKEN_ID):
            raise ValueError(
                f"top_k must be -1 or 0 (no limit) or in [1, {MAX_TOKEN_ID}], "
                f"got {_show(self.top_k)}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check_range("max_tokens", self.max_tokens, 1, INT64_MAX)
        _check_range("min_tokens", self.min_tokens, 0, INT64_MAX)
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
            if v is not None:
                _check_range(name, v, 0, MAX_TOKEN_ID)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop must not contain an empty string")
        for t in self.stop_token_ids or []:
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}], got {_show(t)}")
        if self.seed is not None and not INT64_MIN <= self.seed <= UINT64_MAX:
            raise ValueError(
                f"seed must fit in 64 bits ([-2**63, 2**64 - 1]) or be None, got {_show(self.seed)}"
            )
        for tok, bias in (self.logit_bias or {}).items():
            if not 0 <= tok <= MAX_TOKEN_ID:
                raise ValueError(
                    f"logit_bias token ids must be in [0, {MAX_TOKEN_ID}], got {_show(tok)}"
                )
            if bias != float("-inf"):
                _as_float(f"logit_bias[{tok}]", bias)
        if self.structured_outputs is not None:
            self.structured_outputs.verify()
        if self.output_kind not in _OUTPUT_KINDS:
            raise ValueError(
                f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                f"got {_show(self.output_kind)}"
            )
        # (an int set after construction: the enum, which the output paths compare by `is`)
        self.output_kind = RequestOutputKind(self.output_kind)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def clone(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)


__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
