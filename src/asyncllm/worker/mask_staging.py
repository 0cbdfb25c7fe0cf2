"""The grammar bitmask's way to the device, without a sync or a per-step allocation.

The usual step masks every sampling row, in the scheduler's order: its bitmask (pinned
memory the structured manager shares with the grammar process, on CUDA) is copied to the device as it is, with one non-blocking copy,
and the scheduler writes that buffer again once the step's own completion event has
passed; the rows are a device `arange` made once. Any other step (some rows
unconstrained, another order, an unpinned bitmask) goes through one of two pinned
slots: its rows are gathered there with numpy, then copied; a slot is written again
only once the copy that read it has run (an event each). numpy, not torch, does the
host copies: a torch CPU op at this size wakes its thread pool, which costs more than
the copy.

A usual step whose logits are the decode graphs' output buffer is masked by a CUDA graph
of its own (`apply_graphed`: the copy and the masking kernel, one replay): launched one
by one they cost the H200's host 199-234 µs a step at batch 64, the replay 26-59
(docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class _Slot:
    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.masks = torch.empty(rows, words, dtype=torch.int32).pin_memory()
        self.rows = torch.empty(rows, dtype=torch.int64).pin_memory()
        self.masks_np, self.rows_np = self.masks.numpy(), self.rows.numpy()
        self.copied = torch.cuda.Event()  # (never recorded: synchronize() returns at once)


class MaskStaging:
    """Device buffers for `rows` masks of the bitmask's width (made at the first use),
    and two pinned slots for the steps that need a gather."""

    SLOTS = 2
    MAX_GRAPHS = 256  # (past this many, the graphs of sources gone since are let go)

    def __init__(self, rows: int, device: torch.device) -> None:
        self.capacity = rows
        self.device = device
        self._slots: list[_Slot] = []
        self._next = 0
        self._words = 0
        self._dev_masks = self._dev_rows = self._arange = torch.empty(0)
        # (bitmask address (0: copied before), rows, logits address, logits row stride) -> its graph
        self._graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None

    def _make(self, rows: int, words: int) -> None:
        self.capacity, self._words = rows, words
        self._graphs.clear()  # (they wrote the device buffers made here)
        self._slots = [_Slot(rows, words, self.device) for _ in range(self.SLOTS)]
        self._dev_masks = torch.empty(rows, words, dtype=torch.int32, device=self.device)
        self._dev_rows = torch.empty(rows, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(rows, dtype=torch.int64, device=self.device)

    def reserve(self, rows: int, words: int) -> None:
        """Makes the buffers for `rows` masks of `words` words now, if they are lacking:
        before a device step queues its wait (pinned allocations may wait for the
        device)."""
        if words != self._words or rows > self.capacity:
            self._make(max(self.capacity, rows), words)

    def to_device(
        self, masks: torch.Tensor, mask_rows: list[int] | None, logit_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(logits rows, their masks) on the device: row `logit_rows[i]` of the logits
        takes `masks[mask_rows[i]]` (`mask_rows` None: `masks[i]`); and whether `masks`
        itself is read by a copy still to run (then it must not be written before an
        event recorded after this on the current stream has passed)."""
        n, words = len(logit_rows), masks.shape[1]
        self.reserve(n, words)
        dev_masks = self._dev_masks[:n]
        direct = mask_rows is None and masks.is_pinned()
        if direct:
            dev_masks.copy_(masks[:n], non_blocking=True)
        in_order = logit_rows == list(range(n))
        if not direct or not in_order:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % self.SLOTS
            slot.copied.synchronize()  # (the step that used it last has long been copied)
            if not direct:
                src = masks.numpy()
                if mask_rows is None:
                    np.copyto(slot.masks_np[:n], src[:n])
                else:
                    np.take(src, mask_rows, axis=0, out=slot.masks_np[:n])
                dev_masks.copy_(slot.masks[:n], non_blocking=True)
            if not in_order:
                slot.rows_np[:n] = logit_rows
                self._dev_rows[:n].copy_(slot.rows[:n], non_blocking=True)
            slot.copied.record()
        return (self._arange[:n] if in_order else self._dev_rows[:n]), dev_masks, direct

    def direct_buffer(self, rows: int, words: int) -> torch.Tensor:
        """The device buffer that `apply_graphed(copied=True)` masks `rows` rows with,
        for a copy queued elsewhere (contiguous)."""
        self.reserve(rows, words)
        return self._dev_masks[:rows]

    def apply_graphed(
        self, masks: torch.Tensor, logits: torch.Tensor, copied: bool = False
    ) -> bool:
        """Masks the rows of `logits` (on the device, at an address that stays: the
        decode graphs' output) with `masks` (pinned, one row per logits row, in order),
        by replaying a CUDA graph of the copy and the kernel (`copied`: the kernel
        alone: the copy to `direct_buffer` is queued already), made at the first use of these
        addresses and row count (that use runs them eagerly, which also compiles the
        kernel, then captures them). `masks` is read by a copy still to run, as on
        `to_device`'s direct path. False, doing nothing, if `masks` is not pinned (a
        graph cannot copy from pageable memory)."""
        from asyncllm_kernels.bitmask import apply_token_bitmask_

        n, words = logits.shape[0], masks.shape[1]
        self.reserve(n, words)
        key = (0 if copied else masks.data_ptr(), n, logits.data_ptr(), logits.stride(0))
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return True
        if not copied and not masks.is_pinned():
            return False
        dev_masks, rows = self._dev_masks[:n], self._arange[:n]

        def run() -> None:
            if not copied:
                dev_masks.copy_(masks[:n], non_blocking=True)
            apply_token_bitmask_(logits, rows, dev_masks)

        run()
        if len(self._graphs) >= self.MAX_GRAPHS:
            self._graphs.clear()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = graph
        return True
