"""Messages between the frontend and the engine core (msgspec structs)."""

from __future__ import annotations

import msgspec

from asyncllm.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from asyncllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: never past max_model_len
    arrival_time: float
    priority: int = 0


__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "SchedulerStats"]
