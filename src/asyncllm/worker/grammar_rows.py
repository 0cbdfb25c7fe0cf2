"""Structured outputs on the runner's side: a step's grammar bitmask applied to its
logits, and a device step's handshake with the grammar process.

The bitmask and a device step's tokens and flags live in the structured manager's
shared memory (`GrammarMemory`, attached at start-up), found by the indices a
SchedulerOutput names. The masks go to the device without a sync (`MaskStaging`); a
device step (`GrammarSync`) hands the tokens it needs over with its launch and waits
for its bitmask on the device (`GrammarHandshake`), so the host waits for neither.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.sample import ops
from asyncllm.step_io import GrammarMemory, GrammarSync, SchedulerOutput
from asyncllm.worker.grammar_handshake import GrammarHandshake
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.mask_staging import MaskStaging
from asyncllm.worker.step_buffers import StepBuffers
from asyncllm.worker.step_inputs import StepInputs


class GrammarRows:
    def __init__(
        self,
        batch: InputBatch,
        buffers: StepBuffers,
        last_sampled: torch.Tensor,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.buffers = buffers
        self.last_sampled = last_sampled  # [rows + 1]: the last row's token is -1
        self.max_num_seqs = max_num_seqs
        self.device = device
        # The structured manager's shared memory, where a step's bitmask and handshake
        # are found by index (set at start-up); per bitmask buffer, the event after the
        # copy that reads it (None: none pending); the last device step whose tokens
        # ahead were handed over.
        self.memory: GrammarMemory | None = None
        self.bitmask_copied: list[torch.cuda.Event | None] = [None, None]
        self.tokens_given_seq = 0
        self.handshake: GrammarHandshake | None = None  # (CUDA, at the first device step)
        self._mask_staging: MaskStaging | None = None  # (CUDA, at the first grammar mask)

    def sync(self, so: SchedulerOutput) -> GrammarSync | None:
        """A device step's handshake (None: not one), on the shared memory; the
        handshake is made at the first."""
        if not so.grammar_seq:
            return None
        assert self.memory is not None, "no grammar memory attached"
        sync = self.memory.sync(so.grammar_seq, so.grammar_ahead_req_ids)
        if self.handshake is None:
            self.handshake = GrammarHandshake()
        return sync

    def masks(self, so: SchedulerOutput) -> torch.Tensor | None:
        """The step's grammar bitmask (a view of the shared buffer; None: none)."""
        if so.grammar_buffer is None:
            return None
        assert self.memory is not None, "no grammar memory attached"
        return self.memory.bitmask(so.grammar_buffer, so.grammar_rows()[0])

    def wait_bitmask_copied(self, buffer: int) -> None:
        """Waits until the copy that reads bitmask buffer `buffer` for its last step has
        run (the structured manager writes it again next)."""
        copied = self.bitmask_copied[buffer]
        if copied is not None and not copied.query():  # (at depth 2 it has long run)
            copied.synchronize()

    # -- a device step's tokens ahead --------------------------------------------------

    def write_rows(self, sync: GrammarSync) -> int:
        """Writes the persistent rows of a device step's requests ahead to the step
        buffers (a request the runner does not hold: the row whose token is -1); their
        number."""
        none = len(self.last_sampled) - 1
        requests = self.batch.requests
        k = len(sync.ahead_req_ids)
        self.buffers.grammar_rows.np[:k] = [
            state.row if state is not None else none
            for state in map(requests.get, sync.ahead_req_ids)
        ]
        return k

    def handshake_alone(self, sync: GrammarSync) -> None:
        """A device step with nothing to run still hands its tokens ahead over (with
        only their rows copied to the device) and waits for its masks: the next step's
        hand-over must not overwrite these tokens before the grammar process has read
        them."""
        buf = self.buffers
        buf.wait_until_writable()
        k = self.write_rows(sync)
        if buf.grammar_rows.device is not buf.grammar_rows.cpu:
            buf.grammar_rows.device[:k].copy_(buf.grammar_rows.cpu[:k], non_blocking=True)
        buf.step_queued()
        self.give_tokens_ahead(sync)
        assert self.handshake is not None
        self.handshake.wait_for_masks(sync)

    def give_tokens_ahead(self, sync: GrammarSync) -> None:
        """Queues the hand-over of the last tokens sampled for a device step's requests
        ahead (their rows on the device already) to the grammar process."""
        k = len(sync.ahead_req_ids)
        rows = self.buffers.grammar_rows
        first, last = (int(rows.np[0]), int(rows.np[k - 1])) if k else (0, -1)
        in_line = last - first == k - 1 and (k < 3 or bool((np.diff(rows.np[:k]) == 1).all()))
        assert self.handshake is not None
        self.handshake.give_tokens(
            sync, self.last_sampled, rows.device[:k], first if in_line else None
        )
        self.tokens_given_seq = sync.seq

    # -- the masks ---------------------------------------------------------------------

    def mask_logits(
        self,
        so: SchedulerOutput,
        sync: GrammarSync | None,
        inputs: StepInputs,
        logits: torch.Tensor,
        graphed: bool,
        done: torch.cuda.Event | None,
    ) -> None:
        """Masks the step's logits with its bitmask, if it has one; a device step's
        masks are waited for on the device first (`graphed`: the logits are a decode
        graph's output; `done`: the step's event, after which the copies have run)."""
        staged = False
        masks = self.masks(so)
        if sync is not None:
            assert masks is not None
            staged = self._stage_device_step(sync, masks, inputs, graphed, so)
        if masks is not None:
            assert so.grammar_buffer is not None
            # A copy still to run reads the scheduler's bitmask: it writes that buffer
            # again once this step's event has passed, recorded even if the rest fails.
            read_later = self.apply_bitmask(so, inputs, logits, graphed, staged, masks, sync)
            self.bitmask_copied[so.grammar_buffer] = done if read_later else None

    def _stage_device_step(
        self,
        sync: GrammarSync,
        masks: torch.Tensor,
        inputs: StepInputs,
        graphed: bool,
        so: SchedulerOutput,
    ) -> bool:
        """Queues a device step's wait for its masks; whether the bitmask's copy is
        queued too (`apply_bitmask`'s `staged`)."""
        # (the staging's buffers first: making them may wait for the device, which
        # would then wait for this step's masks)
        if self.device.type == "cuda":
            self.staging().reserve(*masks.shape)
        assert self.handshake is not None
        if self._masks_graphed(so, inputs, graphed):
            # (the usual device step: the bitmask's copy waits on the handshake's
            # stream, beside the forward; only the masking kernel waits for it)
            buffer = self.staging().direct_buffer(*masks.shape)
            self.handshake.copy_when_filled(sync, buffer, masks)
            return True
        self.handshake.wait_for_masks(sync)
        return False

    def _masks_graphed(self, so: SchedulerOutput, inputs: StepInputs, graphed: bool) -> bool:
        """Whether a device step's masks take the usual way: every constrained row
        samples, in order, and the logits are a decode graph's (its bitmask, in the
        manager's shared memory, is pinned)."""
        return (
            self.device.type == "cuda"
            and graphed
            and inputs.sampled_req_ids() == so.structured_req_ids
        )

    def apply_bitmask(
        self,
        so: SchedulerOutput,
        inputs: StepInputs,
        logits: torch.Tensor,
        graphed: bool,
        staged: bool,
        masks: torch.Tensor,
        sync: GrammarSync | None,
    ) -> bool:
        """Masks the logits of the structured-output requests that sample this step with
        their rows of the scheduler's bitmask (on the device; `staged`: the bitmask's
        copy is queued already, `copy_when_filled`); whether the bitmask is read by a
        copy still to run. Nothing here waits for the device: on CUDA the bitmask is
        pinned and copied without a sync (MaskStaging)."""
        if staged:  # (`_masks_graphed` said so: the usual step, its copy queued)
            return self.staging().apply_graphed(masks, logits, copied=True)
        sampled = inputs.sampled_req_ids()
        staging = self.staging() if self.device.type == "cuda" else None
        drafts = _draft_rows(so, inputs, sampled) if inputs.spec else ([], [])
        if sampled == so.structured_req_ids and not drafts[0]:  # (the usual step)
            if staging is not None and graphed and staging.apply_graphed(masks, logits):
                return True  # (a decode graph's logits: masked by a graph of its own)
            logit_rows, in_order = list(range(len(sampled))), True
            mask_rows = logit_rows
        else:
            logit_rows, mask_rows = _constrained_rows(sampled, so.structured_req_ids)
            logit_rows += drafts[0]
            mask_rows += drafts[1]
            in_order = mask_rows == list(range(len(mask_rows)))
        if not logit_rows:
            return False
        read_later = False
        if not in_order and sync is not None:
            # (a device step whose masks are gathered on the host, once filled: only when
            # the runner lacks one of its constrained requests, the orders being the same)
            assert self.handshake is not None
            self.handshake.wait_on_host(sync)
        if staging is not None:
            rows, masks, read_later = staging.to_device(
                masks, None if in_order else mask_rows, logit_rows
            )
        else:
            rows = torch.tensor(logit_rows, dtype=torch.int64)
            masks = masks[: len(mask_rows)] if in_order else masks[mask_rows]
        ops.apply_token_bitmask(logits, rows, masks)
        return read_later

    def staging(self) -> MaskStaging:
        if self._mask_staging is None:
            self._mask_staging = MaskStaging(self.max_num_seqs, self.device)
        return self._mask_staging


def _constrained_rows(sampled: list[str], structured: list[str]) -> tuple[list[int], list[int]]:
    """The logits rows of the sampling requests that have a bitmask row, and those rows."""
    index = {rid: k for k, rid in enumerate(structured)}
    logit_rows, mask_rows = [], []
    for k, rid in enumerate(sampled):
        j = index.get(rid)
        if j is not None:
            logit_rows.append(k)
            mask_rows.append(j)
    return logit_rows, mask_rows


def _draft_rows(
    so: SchedulerOutput, inputs: StepInputs, sampled: list[str]
) -> tuple[list[int], list[int]]:
    """The logits rows of the drafts that constrained requests verify, and their
    bitmask rows (`SchedulerOutput.grammar_rows`)."""
    _, first = so.grammar_rows()
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for k, o, d in inputs.draft_rows():
        f = first.get(sampled[k])
        if f is not None:
            logit_rows += range(o, o + len(d))
            mask_rows += range(f, f + len(d))
    return logit_rows, mask_rows
