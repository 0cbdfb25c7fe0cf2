"""One step's batch, gathered from the persistent batch into the step buffers with
numpy (no tensor is built from a Python list): token ids, positions, slot mapping,
query start offsets, sequence lengths, block table, and which requests sample.

A request verifying draft tokens (speculative decoding) computes its last token and
its drafts, and samples at each of those positions: its first row is among the
step's one-per-request logit rows (`samples`, in batch order), its other rows follow
all of those (`spec`, in the same order), so a step with drafts indexes its first
len(samples) rows as any step does."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncllm.worker.input_batch import CachedRequestState, InputBatch
from asyncllm.worker.step_buffers import StepBuffers, padded_size


@dataclass
class StepInputs:
    """One step's batch: S requests in the scheduler's order, T tokens back to back, in
    the runner's step buffers (padded to `graph_size` tokens and sequences when the step
    replays a CUDA graph)."""

    states: list[CachedRequestState]  # [S]
    rows: np.ndarray  # [S] persistent-batch row of each request
    query_start_loc: np.ndarray  # [S + 1] int32: offset of each request's chunk
    num_computed: np.ndarray  # [S] int32: tokens in the cache before this step
    seq_lens: np.ndarray  # [S] int32: tokens in the cache after this step
    num_tokens: int  # T
    samples: np.ndarray  # indices (into states) of the requests that sample
    graph_size: int | None  # the captured batch size this step replays, if any
    num_pending: int = 0  # input tokens still being sampled by the step in flight
    # Requests verifying drafts: (index into `samples`, its drafts), in batch order; the
    # rows of its drafts' positions follow the len(samples) first rows in this order.
    spec: list[tuple[int, list[int]]] | None = None
    num_logit_rows: int = -1  # rows of logits the step samples (-1: len(samples))
    # The graph's tokens per request: 1 for a decode graph, 1 + k for a verification
    # graph (its batch padded to graph_size * graph_query_len tokens).
    graph_query_len: int = 1

    def __post_init__(self) -> None:
        if self.num_logit_rows < 0:
            self.num_logit_rows = len(self.samples)

    def draft_rows(self) -> list[tuple[int, int, list[int]]]:
        """(index into `samples`, its first draft row, its drafts) per request verifying
        drafts (`extra_rows`)."""
        return extra_rows(len(self.samples), self.spec or [])

    def sampled_req_ids(self) -> list[str]:
        """The ids of the requests that sample, in batch order."""
        states = self.states
        if len(self.samples) == len(states):
            return [s.req_id for s in states]
        return [states[i].req_id for i in self.samples]


def extra_rows(
    num_states: int, spec: list[tuple[int, list[int]]]
) -> list[tuple[int, int, list[int]]]:
    """(state index, its first draft row, its drafts) per request verifying drafts: the
    rows after the `num_states` first ones, in `spec`'s order."""
    out, o = [], num_states
    for k, d in spec:
        out.append((k, o, d))
        o += len(d)
    return out


def gather_step_inputs(
    batch: InputBatch,
    buf: StepBuffers,
    scheduled: dict[str, int],
    block_size: int,
    capture_sizes: list[int],
    drafts: dict[str, list[int]] | None = None,
    verify_graphs: tuple[list[int], int] = ([], 1),
) -> StepInputs:
    """Writes the host side of the step buffers (`scheduled`: request id -> tokens, in
    batch order) with vectorised gathers from the persistent arrays; picks the captured
    size a decode step is padded to. A token past the known ones (being sampled by the
    step in flight) is listed in `pending_at`/`pending_rows`, for the device to fill;
    a draft token is written after its request's known tokens (`drafts`).
    `verify_graphs`: the captured sizes of verification graphs and their tokens per
    request: a step whose every request computes its last token and at most that many
    minus one drafts (and samples) is padded to one."""
    states = [batch.requests[r] for r in scheduled]
    S = len(states)
    rows = np.fromiter((s.row for s in states), dtype=np.int64, count=S)
    n = np.fromiter(scheduled.values(), dtype=np.int32, count=S)
    qsl = buf.query_start_loc.np[: S + 1]
    qsl[0] = 0
    np.cumsum(n, out=qsl[1:])
    T = int(qsl[S])
    computed = batch.num_computed_tokens[rows]
    seq_lens = buf.seq_lens.np[:S]
    np.add(computed, n, out=seq_lens)
    num_drafts = None
    if drafts:
        num_drafts = np.zeros(S, dtype=np.int32)
        index = {s.req_id: i for i, s in enumerate(states)}
        for rid, ids in drafts.items():
            i = index.get(rid)
            if i is not None:  # (a request the runner could not take is not here)
                row = states[i].row  # (after its known tokens and those in flight)
                end = int(batch.num_tokens[row] + batch.num_pending[row])
                batch.token_ids[row, end : end + len(ids)] = ids
                num_drafts[i] = len(ids)
    if T == S:  # one token each: a decode step (or one-token chunks)
        tok_rows, pos = rows, computed.astype(np.int64)
    else:
        tok_req = np.repeat(np.arange(S), n)  # each token's request
        pos = computed[tok_req] + (np.arange(T) - qsl[:-1][tok_req])
        tok_rows = rows[tok_req]
    bs = block_size
    buf.positions.np[:T] = pos
    buf.input_ids.np[:T] = batch.token_ids[tok_rows, pos]
    # Tokens past the known ones are being sampled by the step in flight (drafts follow
    # those, written above).
    known = batch.num_tokens[tok_rows]
    past = pos >= known
    if num_drafts is not None:
        past &= pos < known + batch.num_pending[tok_rows]
    pending = np.nonzero(past)[0]
    buf.pending_at.np[: len(pending)] = pending
    buf.pending_rows.np[: len(pending)] = tok_rows[pending]
    buf.slot_mapping.np[:, :T] = batch.block_table[:, tok_rows, pos // bs] * bs + pos % bs
    np.take(batch.block_table, rows, axis=1, out=buf.block_table.np[:, :S])
    samples = np.nonzero(seq_lens >= batch.num_tokens[rows] + batch.num_pending[rows])[0]
    buf.sample_rows.np[: len(samples)] = rows[samples]
    buf.logit_rows.np[: len(samples)] = qsl[1:][samples] - 1
    spec, num_logit_rows = None, len(samples)
    if num_drafts is not None:
        spec = []
        for k, i in enumerate(samples.tolist()):
            nd = int(num_drafts[i])
            if nd:
                first = int(qsl[i])  # (its last token's row: it predicts the first draft)
                buf.logit_rows.np[k] = first
                buf.logit_rows.np[num_logit_rows : num_logit_rows + nd] = np.arange(
                    first + 1, first + 1 + nd
                )
                buf.sample_rows.np[num_logit_rows : num_logit_rows + nd] = rows[i]
                num_logit_rows += nd
                spec.append((k, drafts[states[i].req_id]))  # type: ignore[index]
    graph_size, graph_query_len = None, 1
    if len(samples) == S:
        if T == S and capture_sizes:
            graph_size = padded_size(S, capture_sizes)
        elif spec and verify_graphs[0] and num_drafts is not None:
            q = verify_graphs[1]
            if bool((n == 1 + num_drafts).all()) and int(n.max()) <= q:
                graph_size = padded_size(S, verify_graphs[0])
                graph_query_len = q if graph_size is not None else 1
    return StepInputs(
        states=states,
        rows=rows,
        query_start_loc=qsl,
        num_computed=computed,
        seq_lens=seq_lens,
        num_tokens=T,
        samples=samples,
        graph_size=graph_size,
        num_pending=len(pending),
        spec=spec,
        num_logit_rows=num_logit_rows,
        graph_query_len=graph_query_len,
    )
