"""Per-row sampling parameters and penalty state of the persistent batch, on the device.

Each request's parameters are written into its row once, when it joins the batch
(host arrays, copied to the device on the next step); a step gathers the rows of the
requests that sample with one index per tensor. Which optional transforms a step needs
(top-k, top-p, min-p, penalties, min_tokens, logprobs) is read from the host arrays
with numpy, so no step loops over requests in Python unless one of them has a seed, a
logit bias or an unmet `min_tokens`.

Penalties: rows of requests with a repetition, presence or frequency penalty keep their
prompt tokens (a [rows, vocab] mask) and their output-token counts on the device,
filled when the request joins and updated in place with each sampled token; nothing
rebuilds them per step. Both tensors are allocated on first use (or by the memory
profile, so their memory is counted before the KV cache is sized).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.sample.sampler import SamplingMetadata
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.input_batch import CachedRequestState
from asyncllm.worker.step_buffers import HostDeviceBuffer

_SEED_MIX = 0x9E3779B97F4A7C15


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request at its n-th output token: a function of
    (seed, n) only, so draws do not depend on batch mates or on preemptions."""
    return (seed * _SEED_MIX + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows, self.vocab_size, self.device = max_num_reqs, vocab_size, device
        R = max_num_reqs

        def buf(dtype: torch.dtype) -> HostDeviceBuffer:
            # Not pinned: rows are written while a step in flight may still be copying.
            return HostDeviceBuffer((R,), dtype, device, pinned=False)

        self.temperature = buf(torch.float32)
        self.greedy = buf(torch.bool)
        self.top_k = buf(torch.int64)
        self.top_p = buf(torch.float32)
        self.min_p = buf(torch.float32)
        self.repetition_penalty = buf(torch.float32)
        self.presence_penalty = buf(torch.float32)
        self.frequency_penalty = buf(torch.float32)
        self._device_bufs = (
            self.temperature,
            self.greedy,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
        )
        # Host-only: what a step needs to decide, without touching Python objects.
        self.penalized = np.zeros(R, dtype=bool)
        self.needs_python = np.zeros(R, dtype=bool)  # a seed, a logit bias or min_tokens
        self.num_logprobs = np.full(R, -1, dtype=np.int64)
        self._dirty = False
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool
        self.output_counts: torch.Tensor | None = None  # [R, V] int32

    # -- rows ----------------------------------------------------------------------

    def add(self, row: int, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        greedy = params.is_greedy
        self.temperature.np[row] = 1.0 if greedy else params.temperature
        self.greedy.np[row] = greedy
        self.top_k.np[row] = params.top_k
        self.top_p.np[row] = params.top_p
        self.min_p.np[row] = params.min_p
        self.repetition_penalty.np[row] = params.repetition_penalty
        self.presence_penalty.np[row] = params.presence_penalty
        self.frequency_penalty.np[row] = params.frequency_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.needs_python[row] = (
            params.seed is not None or bool(params.logit_bias) or params.min_tokens > 0
        )
        self.penalized[row] = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self._dirty = True
        if self.penalized[row]:
            self._fill_penalty_row(row, prompt, output)

    def allocate_penalty_state(self) -> None:
        if self.prompt_mask is None:
            shape = (self.num_rows, self.vocab_size)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)

    def _fill_penalty_row(self, row: int, prompt: list[int], output: list[int]) -> None:
        self.allocate_penalty_state()
        assert self.prompt_mask is not None and self.output_counts is not None
        self.prompt_mask[row] = False
        self.output_counts[row] = 0
        if prompt:
            ids = torch.tensor(prompt, dtype=torch.int64).to(self.device, non_blocking=True)
            self.prompt_mask[row].index_fill_(0, ids, True)
        if output:
            ids = torch.tensor(output, dtype=torch.int64).to(self.device, non_blocking=True)
            ones = torch.ones(len(output), dtype=torch.int32, device=self.device)
            self.output_counts[row].index_add_(0, ids, ones)

    def record_sampled(
        self, rows: np.ndarray, rows_dev: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Counts each penalized row's new token (on the device, no sync)."""
        pen = self.penalized[rows]
        if not pen.any() or self.output_counts is None:
            return
        if not pen.all():
            keep = torch.from_numpy(np.nonzero(pen)[0]).to(self.device, non_blocking=True)
            rows_dev, tokens = rows_dev.index_select(0, keep), tokens.index_select(0, keep)
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.output_counts.index_put_((rows_dev, tokens), ones, accumulate=True)

    @torch.inference_mode()
    def record_tokens(self, row: int, tokens: list[int]) -> None:
        """Counts accepted draft tokens of a penalized row (once they are known)."""
        if not tokens or not self.penalized[row] or self.output_counts is None:
            return
        ids = torch.tensor(tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        ones = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
        self.output_counts[row].index_add_(0, ids, ones)

    # -- a step --------------------------------------------------------------------

    def metadata(
        self,
        states: list[CachedRequestState],
        rows: np.ndarray,
        rows_dev: torch.Tensor,
        num_pending: np.ndarray,
        extra_counts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """The sampling metadata of `states` (persistent rows `rows`, also on the device
        as `rows_dev`; `num_pending[i]`: tokens of states[i] sampled by a step in flight,
        or drafts before its position, not in its output ids yet), gathered from the
        per-row tensors. A request may have several rows (one per position it verifies);
        `extra_counts` (rows, tokens) adds those drafts to the rows' output counts."""
        if self._dirty:
            for b in self._device_bufs:
                b.copy_to_device(self.num_rows)
            self._dirty = False
        greedy = self.greedy.np[rows]
        all_greedy = bool(greedy.all())
        md = SamplingMetadata(  # (an all-greedy step gathers no temperatures: an argmax)
            temperature=None if all_greedy else self.temperature.device.index_select(0, rows_dev),
            is_greedy=None if all_greedy else self.greedy.device.index_select(0, rows_dev),
            all_greedy=all_greedy,
            any_greedy=bool(greedy.any()),
        )
        random = ~greedy
        if (random & (self.top_k.np[rows] > 0)).any():
            md.top_k = self.top_k.device.index_select(0, rows_dev)
        if (random & (self.top_p.np[rows] < 1)).any():
            md.top_p = self.top_p.device.index_select(0, rows_dev)
        if (random & (self.min_p.np[rows] > 0)).any():
            md.min_p = self.min_p.device.index_select(0, rows_dev)
        pen = self.penalized[rows]
        if pen.any():
            assert self.prompt_mask is not None and self.output_counts is not None
            counts = self.output_counts.index_select(0, rows_dev)
            if extra_counts is not None and len(extra_counts[0]):
                at = tuple(torch.from_numpy(a).to(self.device) for a in extra_counts)
                counts.index_put_(at, torch.ones_like(at[0], dtype=counts.dtype), accumulate=True)
            if (self.repetition_penalty.np[rows] != 1.0).any():
                md.seen_mask = self.prompt_mask.index_select(0, rows_dev) | (counts > 0)
                md.repetition_penalty = self.repetition_penalty.device.index_select(0, rows_dev)
            if (self.presence_penalty.np[rows] != 0).any() or (
                self.frequency_penalty.np[rows] != 0
            ).any():
                md.output_counts = counts
                md.presence_penalty = self.presence_penalty.device.index_select(0, rows_dev)
                md.frequency_penalty = self.frequency_penalty.device.index_select(0, rows_dev)
        for i in np.nonzero(self.needs_python[rows])[0].tolist():
            self._python_params(md, i, states[i], len(states), int(num_pending[i]))
        want = self.num_logprobs[rows]
        md.max_num_logprobs = int(want.max()) if (want >= 0).any() else None
        return md

    def _python_params(
        self, md: SamplingMetadata, i: int, s: CachedRequestState, num_rows: int, pending: int
    ) -> None:
        """The rare per-request parts: a seeded generator, a logit bias, min_tokens (by
        the position of the token this step samples)."""
        p = s.sampling_params
        num_output = len(s.output_token_ids) + pending
        if p.seed is not None and s.generator is not None and not p.is_greedy:
            gen = s.generator
            if any(g is gen for g in md.generators.values()):  # (another position of it)
                gen = torch.Generator(device=self.device)
            gen.manual_seed(step_seed(p.seed, num_output))
            md.generators[i] = gen
        if p.logit_bias:
            if md.logit_bias is None:
                md.logit_bias = torch.zeros(num_rows, self.vocab_size, device=self.device)
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            vals = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            md.logit_bias[i].index_put_(  # (no stream sync: a staged copy)
                (ids.to(self.device, non_blocking=True),), vals.to(self.device, non_blocking=True)
            )
        if num_output < p.min_tokens:
            blocked = list(p.stop_token_ids or ())
            eos = s.eos_token_id
            if eos is not None and not p.ignore_eos and 0 <= eos < self.vocab_size:
                blocked.append(eos)  # (an id past the vocabulary is never drawn)
            if blocked:
                md.blocked_tokens.append((i, blocked))
