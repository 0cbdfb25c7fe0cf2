"""Every message that crosses the process boundary between a frontend and its engine
core: msgspec structs, sent as msgpack by `engine.serial` (which refuses anything else).

A leaf module: the frontend, the engine and the core's scheduler all import it, and it
imports only other leaves. Each message type has its own one-byte kind on the wire.

frontend -> core: EngineStartup (first, once), EngineCoreRequest, AbortRequests,
UtilityCall. core -> frontend: ResolvedConfig (once, as soon as the core has resolved
the model), EngineReady (once, when it serves), EngineCoreOutputs, UtilityResult,
EngineDead (last).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import TokenLogprobs

# --- frontend -> core ------------------------------------------------------------------

WireValue = str | int | float | bool | list[str] | dict[str, int | str] | None


class EngineStartup(msgspec.Struct, kw_only=True):
    """The engine arguments (EngineArgs fields as plain values), sent before anything.
    The core resolves them (the model's folder, its config, the device and dtype): the
    host never imports torch or transformers to do so."""

    engine_args: dict[str, WireValue]


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int | None  # None: as many as fit (the core caps it by max_model_len)
    arrival_time: float
    priority: int = 0


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


# --- core -> frontend ------------------------------------------------------------------


class ResolvedConfig(msgspec.Struct, kw_only=True):
    """The engine configuration as the core resolved it: what the host side needs to
    check and process requests, and to report what it serves. Sent before the model
    loads, so the host starts its tokenizer meanwhile."""

    model: str | None  # what the user named (None: the embedded default)
    model_path: str  # the local folder the model was resolved to
    tokenizer: str | None  # the tokenizer's folder or name (None: skip_tokenizer_init)
    architecture: str
    load_format: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None  # the model config's (the tokenizer's wins where it has one)
    max_logprobs: int
    dtype: str  # "float32", "bfloat16", ...
    device: str  # "cpu", "cuda:0", ...
    async_scheduling: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    attention_backend: str | None
    enforce_eager: bool
    hf_config: dict[str, Any]  # the model's config.json as transformers normalised it


class EngineReady(msgspec.Struct, kw_only=True):
    """The core loaded its model and sized its KV cache (the rest of what the host
    needs came before, in ResolvedConfig)."""

    num_blocks: int
    startup_seconds: dict[str, float] = {}  # the core's start-up, by stage


class DeadKind(enum.StrEnum):
    STARTUP_FAILED = "startup_failed"  # the core never became ready
    STOPPED = "stopped"  # SIGTERM (a terminal's SIGINT is the host's)
    CRASHED = "crashed"  # an exception in the core's loop


class EngineDead(msgspec.Struct, array_like=True):
    """The core's last message: why it is going away (and, for a failed start-up, the
    class of the exception, which the host chains as the cause when it is a builtin)."""

    kind: DeadKind
    reason: str
    error_type: str | None = None


class ErrorKind(enum.StrEnum):
    OVERLOADED = "overloaded"  # refused: max_waiting_requests are already waiting
    INVALID = "invalid"  # refused: the core found the request malformed
    FAILED = "failed"  # accepted, then failed in the core (the engine lives on)


class RequestError(msgspec.Struct, array_like=True):
    kind: ErrorKind
    message: str


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request got from one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: TokenLogprobs | None = None
    new_prompt_logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # the request was refused or failed
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
    # blocks requests hold in each KV cache group (model/kv_groups.py)
    num_held_blocks_per_group: list[int] = []
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
    # speculative decoding: requests that verified drafts (one per request and step),
    # the drafts they verified, and those the model agreed with
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    cpu_threads: int = 0  # the core's torch threads now (in get_stats' answer only)


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """One step's outputs, one message."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


# --- kinds on the wire -----------------------------------------------------------------


class MsgKind(bytes, enum.Enum):
    # frontend -> core
    STARTUP = b"C"
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    # core -> frontend
    CONFIG = b"G"
    READY = b"R"
    OUTPUTS = b"O"
    UTILITY_RESULT = b"V"
    DEAD = b"D"


MESSAGE_TYPES: dict[MsgKind, type[msgspec.Struct]] = {
    MsgKind.STARTUP: EngineStartup,
    MsgKind.ADD: EngineCoreRequest,
    MsgKind.ABORT: AbortRequests,
    MsgKind.UTILITY: UtilityCall,
    MsgKind.CONFIG: ResolvedConfig,
    MsgKind.READY: EngineReady,
    MsgKind.OUTPUTS: EngineCoreOutputs,
    MsgKind.UTILITY_RESULT: UtilityResult,
    MsgKind.DEAD: EngineDead,
}
KIND_OF: dict[type, MsgKind] = {t: k for k, t in MESSAGE_TYPES.items()}
TO_CORE = (MsgKind.STARTUP, MsgKind.ADD, MsgKind.ABORT, MsgKind.UTILITY)
FROM_CORE = (MsgKind.CONFIG, MsgKind.READY, MsgKind.OUTPUTS, MsgKind.UTILITY_RESULT, MsgKind.DEAD)
