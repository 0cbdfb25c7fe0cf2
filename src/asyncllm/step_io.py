"""What crosses between the scheduler and the model runner each step.

A leaf module (no torch, no engine imports) so that both sides, and the wire format,
can use it without either reaching up the dependency chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or is seeing again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after a preemption
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hit)
    eos_token_id: int | None = None  # masked while fewer than min_tokens are out


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)  # [] or per group
    num_computed_tokens: list[int] = field(default_factory=list)
    # Under pipeline parallelism only (`SchedulerConfig.runner_holds_samples` False):
    # the tokens each request computes this step, for the stages that never sample.
    new_token_ids: list[list[int]] = field(default_factory=list)


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
    in memory the two share, as the model runner sees it: `seq` and `ahead_req_ids` come
    in the SchedulerOutput (`grammar_seq`, `grammar_ahead_req_ids`), `tokens` and
    `flags` from the runner's `GrammarMemory`. After the step before has sampled, the
    device writes the tokens it sampled for `ahead_req_ids` (in order, -1 for a request
    it does not hold) to `tokens` (int64), then sets `flags[TOKENS_FLAG]` to `seq`; the
    grammar process fills the step's bitmask, then sets `flags[MASK_FLAG]` to `seq`,
    which the device waits for before it copies the bitmask and samples."""

    seq: int
    ahead_req_ids: list[str]
    tokens: Any
    flags: Any


class GrammarMemory(Protocol):
    """The worker side's way to the structured manager's shared memory (handed to the
    runner at start-up, `Executor.attach_grammar_memory`), looked up by the plain fields
    of a SchedulerOutput."""

    def bitmask(self, index: int, rows: int) -> Any:
        """The first `rows` rows of bitmask buffer `index` (0 or 1): a tensor view, no
        copy."""
        ...

    def sync(self, seq: int, ahead_req_ids: list[str]) -> GrammarSync:
        """A device step's handshake, on the shared tokens and flags."""
        ...


@dataclass
class SchedulerOutput:
    """One step, as the scheduler hands it to the executor: plain data only (lists,
    dicts, ints, strings, SamplingParams), so it can go over the wire
    (engine/serial.py's `StepEncoder`); the bitmask and the grammar handshake's shared
    memory are named by index, and the worker finds them through its `GrammarMemory`."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens this step, in batch order
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished, aborted or preempted since last step.
    finished_req_ids: set[str]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Structured outputs: row i of the bitmask (int32, 32 tokens a word; a set bit allows
    # the token) constrains the token that structured_req_ids[i] samples this step; then
    # come one row per draft of those that verify drafts, in the same order (the row of
    # draft j: what may follow drafts 0..j; `grammar_rows`). The bitmask is the first
    # rows of the structured manager's shared buffer `grammar_buffer` (0 or 1; None: no
    # bitmask).
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_buffer: int | None = None
    # The bitmask is filled after the launch: the runner queues the forward and samples
    # at the launch's `finish_launch()` (the masks need the tokens of the step before).
    grammar_bitmask_later: bool = False
    # A device step (async scheduling on CUDA; 0: not one): the device hands the grammar
    # process the tokens it sampled for `grammar_ahead_req_ids` and waits for the
    # bitmask's flag to reach `grammar_seq` itself; the runner queues it all at launch.
    grammar_seq: int = 0
    grammar_ahead_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request id -> the draft tokens it verifies this step (its
    # scheduled tokens are its last token, then these); ModelRunnerOutput gives it the
    # drafts the model agreed with, then one token of the model's own.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def grammar_rows(self) -> tuple[int, dict[str, int]]:
        """The bitmask's rows, and the first draft row of each constrained request that
        verifies drafts (after one row per constrained request)."""
        rows, first = len(self.structured_req_ids), {}
        drafts = self.scheduled_spec_decode_tokens
        if drafts:
            for rid in self.structured_req_ids:
                d = drafts.get(rid)
                if d:
                    first[rid] = rows
                    rows += len(d)
        return rows, first


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
