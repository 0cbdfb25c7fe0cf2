"""Draft tokens by prompt lookup (the "ngram" method of speculative decoding).

A request's next tokens are guessed from its own context: the longest suffix of its
tokens (prompt and output), between `prompt_lookup_min` and `prompt_lookup_max` tokens
long, that also occurs earlier in them; the tokens that followed that earlier
occurrence (the latest one, where several match equally long) are the drafts, up to
`num_speculative_tokens` of them. Text an agent or an editor asks a model to repeat,
quote or change slightly is found this way, and costs nothing to draft.

Each request's tokens are kept in a numpy buffer here, extended by the tokens appended
since the last call (a request's tokens only ever grow), so one search is a vectorized
scan of its context, not a copy of it.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt_lookup_min ({min_n}) must be in 1..prompt_lookup_max ({max_n})"
            )
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def propose(
        self, req_id: str, token_ids: list[int], max_drafts: int | None = None, skip: int = 0
    ) -> list[int]:
        """Up to `num_speculative_tokens` (or `max_drafts`, if fewer) drafts for the
        request whose known tokens are `token_ids`; [] where no suffix recurs. `skip`:
        tokens after those known that are not known yet (being sampled): the lookup's
        first `skip` tokens stand for them, and the drafts follow."""
        k = self.num_tokens if max_drafts is None else min(self.num_tokens, max_drafts)
        if k <= 0:
            return []
        tokens = self._tokens(req_id, token_ids)
        return propose_ngram(tokens, self.min_n, self.max_n, k + skip)[skip:]

    def forget(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)

    def _tokens(self, req_id: str, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        buf, have = self._buffers.get(req_id, (None, 0))
        if buf is None or have > n:
            buf, have = np.empty(max(2 * n, 64), dtype=np.int64), 0
        elif n > buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = token_ids[have:n]
        self._buffers[req_id] = (buf, n)
        return buf[:n]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The drafts for one context (see the module's docstring)."""
    n = tokens.shape[0]
    if n < min_n + 1 or k <= 0:
        return []
    # Earlier positions j (< n - 1) whose token equals the last one: a match of length 1.
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for size in range(2, max_n + 1):
        if size > n - 1:
            break
        starts = ends - (size - 1)
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[n - size]
        length[ok] = size
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return []
    j = int(ends[np.flatnonzero(length == best)[-1]])  # (the latest of the longest)
    return tokens[j + 1 : min(j + 1 + k, n)].tolist()
