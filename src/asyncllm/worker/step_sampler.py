"""A step's sampling and logprobs, queued with their copies to the host.

One token per sampling request, with the per-row parameters gathered on the device
(`SamplingState`); the sampled ids also stay on the device by persistent row
(`last_sampled`), for the next step's inputs. If the batch cannot be sampled, each
request is sampled alone, and only those that fail alone are reported. Prompt logprobs
are computed `PROMPT_LOGPROB_CHUNK` rows at a time, never for a whole step at once.
Nothing here waits for the device: the results are read once the step's event has
passed (`StepResult.apply`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.model.attention.backend import numpy_to_device
from asyncllm.model.interface import CausalLM
from asyncllm.sample.logits_processor import LogitsProcessor
from asyncllm.sample.sampler import Sampler, gather_logprobs
from asyncllm.worker.input_batch import CachedRequestState, InputBatch
from asyncllm.worker.sampling_state import SamplingState
from asyncllm.worker.step_buffers import StepBuffers
from asyncllm.worker.step_inputs import StepInputs, extra_rows
from asyncllm.worker.step_result import PendingLogprobs, SampledGroup

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_CHUNK = 512  # rows of prompt-logprob logits computed at once


@dataclass
class PromptLogprobRows:
    """One request's prompt positions in this step whose next-token logprobs go out."""

    req_id: str
    num_logprobs: int  # top-n besides the prompt token
    rows: np.ndarray  # rows of the step's hidden states
    targets: np.ndarray  # the prompt token that follows each row


def prompt_logprob_rows(inputs: StepInputs, batch: InputBatch) -> list[PromptLogprobRows]:
    """A request that asked for prompt logprobs gets them for the prompt positions of
    its chunk (each predicts the next prompt token), unless it is resuming after a
    preemption. (Picked before sampling appends tokens: whether a request still owes
    prompt logprobs depends on the tokens it had when the step began.)"""
    qsl = inputs.query_start_loc
    out: list[PromptLogprobRows] = []
    for i, s in enumerate(inputs.states):
        want = s.sampling_params.prompt_logprobs
        if want is None or s.output_token_ids:
            continue  # (resumed after preemption: its prompt logprobs went out already)
        p_len = len(s.prompt_token_ids)
        start, end = int(inputs.num_computed[i]), int(min(inputs.seq_lens[i], p_len - 1))
        if end > start:
            out.append(
                PromptLogprobRows(
                    s.req_id,
                    want,
                    np.arange(qsl[i], qsl[i] + end - start),
                    batch.token_ids[s.row, start + 1 : end + 1],
                )
            )
    return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Queues a copy of a device tensor into pinned host memory (valid once the step's
    event has completed); a CPU tensor is returned as it is."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class StepSampler:
    """Samples a step's logits into the persistent batch's rows."""

    def __init__(
        self,
        batch: InputBatch,
        sampling: SamplingState,
        processors: list[LogitsProcessor],
        buffers: StepBuffers,
        last_sampled: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.sampling = sampling
        self.processors = processors
        self.sampler = Sampler(processors)
        self.buffers = buffers
        self.last_sampled = last_sampled  # [rows + 1] each row's last token, on the device
        self.device = device

    def sample(
        self, inputs: StepInputs, logits: torch.Tensor, apply_earlier: Callable[[], None]
    ) -> tuple[list[SampledGroup], dict[str, str]]:
        """Queues the sampling of one token per sampling request (row k of `logits` is
        `inputs.samples[k]`), and of each position of a request verifying drafts (its
        other rows: `inputs.spec`), and the copy of the tokens to the host. If the batch
        cannot be sampled, each request is sampled alone: those that fail alone are
        returned (request id -> why) and get nothing; if all of them fail, the error is
        the step's and is raised. `apply_earlier` applies the results of the steps in
        flight before this one (logits processors read the output ids)."""
        failed: dict[str, str] = {}
        if not len(inputs.samples):
            return [], failed
        if self.processors:  # they read the output ids: bring them up to date first
            apply_earlier()
        states = [inputs.states[i] for i in inputs.samples]
        rows = inputs.rows[inputs.samples]
        spec = inputs.spec or []
        try:
            rows_dev = self.buffers.sample_rows.device[: inputs.num_logit_rows]
            groups = [self._sample_rows(states, rows, rows_dev, logits, spec)]
        except Exception as batch_error:
            groups = []
            extra = {k: (o, d) for k, o, d in extra_rows(len(states), spec)}
            for k, state in enumerate(states):
                one = rows[k : k + 1]
                o, d = extra.get(k, (0, []))
                picks = [k] + list(range(o, o + len(d)))
                try:
                    one_dev = torch.from_numpy(np.repeat(one, len(picks))).to(self.device)
                    idx = torch.tensor(picks, device=logits.device)
                    one_spec = [(0, d)] if d else []
                    groups.append(
                        self._sample_rows([state], one, one_dev, logits[idx].clone(), one_spec)
                    )
                except Exception as e:  # noqa: BLE001 (tried alone: this request's fault)
                    failed[state.req_id] = f"sampling failed: {type(e).__name__}: {e}"
            if not groups:
                raise batch_error
            logger.warning("requests failed in sampling, the rest of the batch went on: %s", failed)
        for g in groups:
            self.batch.mark_pending(g.rows)
        return groups, failed

    def _sample_rows(
        self,
        states: list[CachedRequestState],
        rows: np.ndarray,
        rows_dev: torch.Tensor,
        logits: torch.Tensor,
        spec: list[tuple[int, list[int]]],
    ) -> SampledGroup:
        """Queues the sampling of one token for each of `states` (persistent rows `rows`,
        row i of `logits`), and, for those verifying drafts (`spec`), one at each draft's
        position (the rows after len(states), in order), with logprobs if any wants
        them, and their copies to the host. A draft position's row samples as the
        request's next output token would: its seed and min_tokens by its output
        position, its penalties counting the drafts before it."""
        n = len(states)
        all_states, all_rows, pending = states, rows, self.batch.num_pending[rows]
        extra_counts = None
        if spec:
            all_states = list(states)
            row_parts, pending_parts = [rows], [pending]
            at_rows: list[int] = []
            at_tokens: list[int] = []
            for k, o, d in extra_rows(n, spec):
                all_states += [states[k]] * len(d)
                row_parts.append(np.full(len(d), rows[k]))
                # (its tokens in flight and the drafts before it)
                pending_parts.append(pending[k] + np.arange(1, len(d) + 1))
                for j in range(1, len(d) + 1):  # (row o + j - 1 follows drafts 0..j-1)
                    at_rows += [o + j - 1] * j
                    at_tokens += d[:j]
            all_rows, pending = np.concatenate(row_parts), np.concatenate(pending_parts)
            extra_counts = (np.asarray(at_rows), np.asarray(at_tokens))
        md = self.sampling.metadata(all_states, all_rows, rows_dev, pending, extra_counts)
        if self.processors:
            md.rows = all_rows.tolist()
            if spec:  # (row o + j - 1 follows drafts 0..j-1)
                md.draft_prefixes = {
                    o + j - 1: (states[k].output_token_ids, d[:j])
                    for k, o, d in extra_rows(n, spec)
                    for j in range(1, len(d) + 1)
                }
        result = self.sampler(logits, md)
        tokens = result.token_ids
        # (a request's first row always gives its first new token; draft rows count once
        # accepted: `SampledGroup.record`)
        self.sampling.record_sampled(rows, rows_dev[:n], tokens[:n])
        self.last_sampled.index_copy_(0, rows_dev[:n], tokens[:n])
        top = None
        if result.logprobs is not None:
            assert result.logprob_token_ids is not None and result.ranks is not None
            ids, lps, ranks = result.logprob_token_ids, result.logprobs, result.ranks
            top = (to_host(ids), to_host(lps), to_host(ranks))
        record = self.sampling.record_tokens if spec else None
        return SampledGroup(states, rows, to_host(tokens), top, spec or None, record)

    def prompt_logprobs(
        self, model: CausalLM, hidden: torch.Tensor | None, prompt_rows: list[PromptLogprobRows]
    ) -> dict[str, PendingLogprobs]:
        """Per request, the logprob and rank of each next prompt token, with the top-n
        (logits in chunks of PROMPT_LOGPROB_CHUNK rows), queued to the host: read once
        the step's event has passed (`PendingLogprobs.read`), no sync here."""
        out: dict[str, PendingLogprobs] = {}
        if not prompt_rows:
            return out
        assert hidden is not None  # (steps with prompt logprobs run eager)
        for p in prompt_rows:
            parts = []
            all_rows, all_targets = (numpy_to_device(a, self.device) for a in (p.rows, p.targets))
            for a in range(0, len(p.rows), PROMPT_LOGPROB_CHUNK):
                rows = all_rows[a : a + PROMPT_LOGPROB_CHUNK]
                targets = all_targets[a : a + PROMPT_LOGPROB_CHUNK]
                logits = model.compute_logits(hidden.index_select(0, rows)).float()
                parts.append(gather_logprobs(logits.log_softmax(-1), targets, p.num_logprobs))
            ids, lps, ranks = (torch.cat(t) for t in zip(*parts))
            out[p.req_id] = PendingLogprobs(to_host(ids), to_host(lps), to_host(ranks))
        return out
