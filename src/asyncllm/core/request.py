"""A request as the engine core sees it: tokens, progress, blocks' hashes, status."""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import TokenLogprobs


class BlockHasher(Protocol):
    """What a request needs of its block hasher (`kv_cache_utils.BlockHasher`)."""

    block_size: int

    def __call__(self, request: Request) -> list[bytes]: ...


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this point is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the core could not serve it (its output carries a RequestError)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* statuses (a preempted request is not finished)."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort"; an error ends with "abort",
        as an abort does); None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "abort",
}


class Request:
    """One request's state in the core.

    `num_computed_tokens` counts the tokens whose K/V the scheduler has handed to the
    runner (advanced when a step is scheduled, reset to 0 by a preemption).
    `num_output_placeholders` counts the tokens that scheduled steps will sample but whose
    values are not known yet (with async scheduling, up to two), and `num_in_flight`
    the scheduled steps of this request whose results have not been applied; a request
    that ends meanwhile keeps its blocks (`held_blocks`) until they have. The block
    hasher, when given, keeps `block_hashes` covering every full block of
    `all_token_ids`; without it (prefix caching off) `block_hashes` stays empty.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: BlockHasher | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens  # already capped by max_model_len
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # Prompt positions whose logprobs went out: a prefill recomputed after a
        # preemption computes them again, and they are not sent twice.
        self.num_prompt_logprobs_sent = 0
        self.first_scheduled_time = 0.0  # time.monotonic() when it first got tokens
        self.num_output_placeholders = 0
        self.num_in_flight = 0
        self.held_blocks: tuple | None = None  # blocks of an ended request, freed later
        # Speculative decoding: whether it drafts (decided when it is added, for its life),
        # and its steps in flight that verify drafts (until applied, its next position is
        # not known: it is not scheduled).
        self.speculates = False
        self.num_verifying = 0
        # How many drafts it may get next (after a partial acceptance: one more than it
        # kept), and the steps it drafts nothing after drafts were all rejected (doubling
        # while they keep failing): drafts that fail cost compute and gain nothing.
        self.draft_cap = 1 << 30
        self.draft_backoff = 0
        self.draft_pause = 0
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)  # kept in step with all_token_ids (hot path)
        self.block_hashes: list[bytes] = []
        self.structured: Any = None  # StructuredRequest: its grammar and matcher, if any
        self._block_hasher = block_hasher
        self._hash_at = 1 << 62  # token count that completes the next block to hash
        if block_hasher is not None:
            self._hash_blocks()

    def _hash_blocks(self) -> None:
        assert self._block_hasher is not None
        self.block_hashes.extend(self._block_hasher(self))
        self._hash_at = (len(self.block_hashes) + 1) * self._block_hasher.block_size

    @property
    def is_finished(self) -> bool:
        """Stopped, length-capped, aborted or failed."""
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Appends sampled tokens and hashes any block they complete, so the block is
        ready for the prefix cache when the scheduler registers it."""
        if isinstance(token_ids, int):
            self.append_token(token_ids)
            return
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.num_tokens = len(self.all_token_ids)
        if self.num_tokens >= self._hash_at:
            self._hash_blocks()

    def append_token(self, token: int) -> None:
        """`append_output_token_ids` of one token (the hot path: one per request a step)."""
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        self.num_tokens += 1
        if self.num_tokens >= self._hash_at:
            self._hash_blocks()

    def check_stop(self, token: int, max_model_len: int) -> bool:
        """Whether `token`, the request's last, ends it; if so, sets its finished status
        (and stop_reason for a stop token). eos and stop tokens count only once
        min_tokens are out; max_tokens and max_model_len always do."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        if num_output >= params.min_tokens:
            if token == self.eos_token_id and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            stop_token_ids = params.stop_token_ids
            if stop_token_ids and token in stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token
                return True
        if num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def take_new_prompt_logprobs(self, lp: TokenLogprobs, start: int) -> TokenLogprobs | None:
        """The prompt logprobs of a chunk whose first position is `start` that were not
        sent before (after a preemption, the prefill computes them again); None if
        none. Counts them as sent."""
        skip = max(0, self.num_prompt_logprobs_sent - start)
        self.num_prompt_logprobs_sent = max(self.num_prompt_logprobs_sent, start + len(lp.ranks))
        if skip == 0:
            return lp
        if skip >= len(lp.ranks):
            return None
        return TokenLogprobs(lp.token_ids[skip:], lp.logprobs[skip:], lp.ranks[skip:])

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
