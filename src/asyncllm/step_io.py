"""What crosses between the scheduler and the model runner each step.

A leaf module (no torch, no engine imports) so that both sides, and the wire format,
can use it without either reaching up the dependency chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or is seeing again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after a preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hit)
    eos_token_id: int | None = None  # masked while fewer than min_tokens are out


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


# A device step's flags (uint32 step numbers, each on its own 64-byte line of the
# FLAG_WORDS words the grammar process shares with the core).
FLAG_WORDS = 32
TOKENS_FLAG = 0  # the device's: the step's tokens are in
MASK_FLAG = 16  # the grammar process's: the step's bitmask is filled


def flag_reached(value: int, seq: int) -> bool:
    """Whether a flag holding `value` has reached step number `seq` (both uint32; the
    numbers wrap)."""
    return (value - seq) & 0xFFFFFFFF < 0x80000000


@dataclass
class GrammarSync:
    """A device step's handshake with the grammar process (structured/grammar_process.py),
    in memory the two share: after the step before has sampled, the device writes the
    tokens it sampled for `ahead_req_ids` (in order, -1 for a request it does not hold)
    to `tokens` (int64), then sets `flags[TOKENS_FLAG]` to `seq`; the grammar process
    fills the step's bitmask, then sets `flags[MASK_FLAG]` to `seq`, which the device
    waits for before it copies the bitmask and samples. `given`: the runner has queued
    the device's hand-over (the host must not write the tokens or their flag then)."""

    seq: int
    ahead_req_ids: list[str]
    tokens: Any
    flags: Any
    given: bool = False


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens this step, in batch order
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_req_ids: set[str]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Structured outputs: row i of the bitmask (int32, 32 tokens a word; a set bit allows
    # the token) constrains the token that structured_req_ids[i] samples this step.
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # The bitmask is filled after the launch: the runner queues the forward and samples
    # at the launch's `finish_launch()` (the masks need the tokens of the step before).
    grammar_bitmask_later: bool = False
    # Set by the model runner when it copies the (pinned) bitmask to the device without
    # a sync: a CUDA event recorded after the copy, which the scheduler waits for before
    # it writes that buffer again.
    grammar_bitmask_copied: Any = None
    # A device step (async scheduling on CUDA): the device hands the grammar process the
    # tokens ahead and waits for the bitmask itself; the runner queues it all at launch.
    grammar_sync: GrammarSync | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Per position: column 0 is the chosen (sampled or prompt) token, then the top-n."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token (1 = most likely)


@dataclass
class ModelRunnerOutput:
    # request id -> tokens sampled this step ([] for a request still in prefill)
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> why: requests the runner could not take (a bad value in their inputs
    # or sampling parameters). It has dropped them; the scheduler ends them with an error,
    # and the rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)
