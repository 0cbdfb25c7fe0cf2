"""The grammar bitmask's way to the device, without a sync or a per-step allocation.

Each constrained step's rows (the scheduler's CPU bitmask, int32) and the logits rows
they mask are copied with numpy into one of two pinned buffers, then to the device with
non-blocking copies. A buffer is written again only once the copy that read it has run
(an event each), so a step in flight never sees the next step's masks. numpy, not
torch, does the host copies: a torch CPU op at this size wakes its thread pool, which
costs more than the copy.
"""

from __future__ import annotations

import numpy as np
import torch


class _Slot:
    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        self.masks = torch.empty(rows, words, dtype=torch.int32).pin_memory()
        self.rows = torch.empty(rows, dtype=torch.int64).pin_memory()
        self.masks_np, self.rows_np = self.masks.numpy(), self.rows.numpy()
        self.dev_masks = torch.empty(rows, words, dtype=torch.int32, device=device)
        self.dev_rows = torch.empty(rows, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event()  # (never recorded: synchronize() returns at once)


class MaskStaging:
    """Two pinned slots of `rows` × the bitmask's width, made at the first use."""

    SLOTS = 2

    def __init__(self, rows: int, device: torch.device) -> None:
        self.capacity = rows
        self.device = device
        self._slots: list[_Slot] = []
        self._next = 0

    def to_device(
        self, masks: torch.Tensor, mask_rows: list[int] | None, logit_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits rows, their masks) on the device: row `logit_rows[i]` of the logits
        takes `masks[mask_rows[i]]` (`mask_rows` None: `masks[i]`)."""
        n, words = len(logit_rows), masks.shape[1]
        if not self._slots or self._slots[0].masks.shape[1] != words or n > self.capacity:
            self.capacity = max(self.capacity, n)
            self._slots = [_Slot(self.capacity, words, self.device) for _ in range(self.SLOTS)]
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        slot.copied.synchronize()  # (the step that used it last has long been copied)
        src = masks.numpy()
        if mask_rows is None:
            np.copyto(slot.masks_np[:n], src[:n])
        else:
            np.take(src, mask_rows, axis=0, out=slot.masks_np[:n])
        slot.rows_np[:n] = logit_rows
        dev_masks, dev_rows = slot.dev_masks[:n], slot.dev_rows[:n]
        dev_masks.copy_(slot.masks[:n], non_blocking=True)
        dev_rows.copy_(slot.rows[:n], non_blocking=True)
        slot.copied.record()
        return dev_rows, dev_masks
