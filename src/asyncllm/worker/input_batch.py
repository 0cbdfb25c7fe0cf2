"""The model runner's persistent per-request state.

Rows are handed out when a request arrives and reused after it leaves; token ids,
progress and block tables live in preallocated numpy arrays so each step's inputs
are gathered with vectorised indexing instead of rebuilt from Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, num_groups: int = 1
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Tokens sampled by steps in flight, not in token_ids yet (async scheduling).
        self.num_pending = np.zeros(max_num_reqs, dtype=np.int32)
        # [KV cache group, row, block]: every group's table covers the same tokens
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.requests)

    def add(
        self, state_args: dict, block_ids: list[list[int]], num_computed_tokens: int
    ) -> CachedRequestState:
        """Gives the request a row. Raises (and takes no row) if it cannot be added: a
        full batch, an id already in it, or more tokens or blocks than fit a row."""
        if not self._free_rows:
            raise RuntimeError(
                f"more than max_num_seqs ({self.max_num_reqs}) requests in the batch"
            )
        state = CachedRequestState(row=self._free_rows[-1], **state_args)
        if state.req_id in self.requests:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        tokens = state.prompt_token_ids + state.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {state.req_id!r} has more than max_model_len tokens")
        if block_ids and len(block_ids) != self.block_table.shape[0]:
            raise ValueError(
                f"request {state.req_id!r} has blocks of {len(block_ids)} KV cache groups, "
                f"the model {self.block_table.shape[0]}"
            )
        if block_ids and len(block_ids[0]) > self.block_table.shape[2]:
            raise ValueError(f"request {state.req_id!r} has more blocks than max_model_len needs")
        row = state.row
        self.token_ids[row, : len(tokens)] = tokens  # raises for ids past int64
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_pending[row] = 0
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self._free_rows.pop()
        self.requests[state.req_id] = state
        return state

    def remove(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
        return state

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """Appends each KV cache group's new blocks ([] or one list per group, all of
        one length) to the row's tables."""
        if not block_ids:
            return
        n, k = int(self.num_blocks[row]), len(block_ids[0])
        if n + k > self.block_table.shape[2]:
            raise RuntimeError("block table overflow: more blocks than max_model_len needs")
        self.block_table[:, row, n : n + k] = block_ids
        self.num_blocks[row] = n + k

    def write_tokens(self, state: CachedRequestState, start: int, tokens: list[int]) -> None:
        """The tokens at positions [start, start + len(tokens)) of a request, as the
        scheduler sent them (a pipeline stage that samples nothing learns its requests'
        new tokens so); those past the known ones are its new output tokens."""
        end = start + len(tokens)
        if not 0 <= start <= state.num_tokens or end > self.max_model_len:
            raise RuntimeError(
                f"request {state.req_id!r}: tokens [{start}, {end}) do not follow its "
                f"{state.num_tokens} known tokens"
            )
        row = state.row
        self.token_ids[row, start:end] = tokens
        if end > state.num_tokens:
            state.output_token_ids.extend(tokens[state.num_tokens - start :])
            self.num_tokens[row] = end

    def mark_pending(self, rows: np.ndarray) -> None:
        """A launched step samples a token for each of these rows (unique)."""
        self.num_pending[rows] += 1

    def take_sampled_tokens(
        self, states: list[CachedRequestState], rows: np.ndarray, tokens: list[int]
    ) -> None:
        """The tokens a launched step sampled for `states` (at persistent rows `rows`,
        one each), now known: appended, and no longer pending. Only for states still in
        the batch (each row its own state's)."""
        self.num_pending[rows] -= 1
        n = self.num_tokens[rows]
        room = n < self.max_model_len
        if room.all():
            self.token_ids[rows, n] = tokens
            self.num_tokens[rows] = n + 1
        else:
            kept = rows[room]
            self.token_ids[kept, n[room]] = np.asarray(tokens, dtype=np.int64)[room]
            self.num_tokens[kept] = n[room] + 1
        for state, token in zip(states, tokens):
            state.output_token_ids.append(token)

    def append_tokens(self, state: CachedRequestState, tokens: list[int]) -> None:
        """More new tokens of a request after `take_sampled_tokens` gave it its first
        (the accepted drafts of a verifying step), as far as max_model_len allows."""
        row = state.row
        n = int(self.num_tokens[row])
        tokens = tokens[: self.max_model_len - n]
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)
        state.output_token_ids.extend(tokens)
