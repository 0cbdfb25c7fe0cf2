"""The checks of a request against the model it is for (vocabulary, length, logprob
limit): one implementation, run by the frontend before anything is sent (so that `LLM`
refuses a batch with a bad prompt before any of it starts) and by the engine core's
admission check (a request may come straight through the socket). What needs no model
is `SamplingParams.verify()`; whether a structured-output constraint can be enforced is
checked by the core alone (it needs xgrammar). A leaf module: no torch."""

from __future__ import annotations

from typing import Any

from asyncllm.sampling_params import SamplingParams


def check_prompt_token_ids(ids: Any, vocab_size: int | None, max_model_len: int) -> list[int]:
    """The prompt's ids as a list; TypeError or ValueError naming the problem. A prompt
    of exactly max_model_len tokens is allowed (it gets the one token its prefill
    samples, as in vLLM)."""
    if not isinstance(ids, list | tuple):
        raise TypeError(f"prompt_token_ids must be a list of int, got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise ValueError("prompt must not be empty (no prompt_token_ids)")
    for t in ids:
        if type(t) is not int:
            raise TypeError(f"prompt_token_ids must hold ints, found {type(t).__name__}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        raise ValueError(f"prompt_token_ids has token id {bad}, outside [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_model_len}")
    return ids


def check_params_for_model(
    params: Any, vocab_size: int | None, max_logprobs: int
) -> SamplingParams:
    """`params` verified (it may have changed since it was made) and checked against the
    model's vocabulary and the engine's logprob limit."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.verify()
    if vocab_size is not None:
        for t in params.stop_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids has token id {t}, outside [0, {vocab_size})")
        for t in params.logit_bias or {}:
            if not 0 <= t < vocab_size:
                raise ValueError(f"logit_bias has token id {t}, outside [0, {vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v is not None and v > max_logprobs:
            raise ValueError(f"{name} is {v}; at most max_logprobs={max_logprobs} are allowed")
    return params
