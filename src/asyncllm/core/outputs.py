"""What the engine core reports per request per step (msgspec structs: they cross
process boundaries as msgpack)."""

from __future__ import annotations

import msgspec

from asyncllm.step_io import TokenLogprobs


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: TokenLogprobs | None = None
    new_prompt_logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the request was refused or failed (e.g. overload)
    # time.monotonic() (one clock for all processes of the machine) when the request was
    # first scheduled; sent with its first tokens, for queue-time statistics
    first_scheduled_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # this step
    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    # since start
    num_steps: int = 0
    num_mixed_steps: int = 0  # prefill and decode tokens in one batch
    num_chunked_prefill_steps: int = 0  # some prompt was only partly computed
    total_prefill_tokens: int = 0
    total_decode_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
