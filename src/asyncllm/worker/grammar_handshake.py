"""The model runner's side of a device step (step_io.GrammarSync). With the step's
launch it queues the hand-over of the tokens the grammar process needs (their copy and
their flag's write; on a side stream where they need no gather); before the sampling,
the wait for the bitmask's flag and the bitmask's copy to the device go on the side
stream (`copy_when_filled`), so the forward queued between runs meanwhile and only the
masking waits for them. The host waits for none of it (asyncllm_kernels/stream_ops.py).
The flags' driver calls and copies are one ctypes call each: torch's copies, and making
the side stream the current one, cost the host more."""

from __future__ import annotations

import time

import torch

from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync, flag_reached
from asyncllm_kernels import stream_ops


class GrammarHandshake:
    def __init__(self) -> None:
        self._addresses: dict[int, int] = {}  # host address of the flags -> the device's
        # (made at the first hand-over: the side stream, and the events that mark the
        # hand-over on the current stream and the bitmask's copy on the side one)
        self._side: tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event] | None = None
        self._gathered = torch.empty(0, dtype=torch.int64)  # (the tokens handed over)

    def _flag(self, sync: GrammarSync, index: int) -> int:
        base = sync.flags.data_ptr()
        address = self._addresses.get(base)
        if address is None:
            address = self._addresses[base] = stream_ops.device_address(base)
        return address + 4 * index

    def give_tokens(
        self, sync: GrammarSync, sampled: torch.Tensor, rows: torch.Tensor, start: int | None = None
    ) -> None:
        """Queues the copy of `sampled[rows]` (on the device, one token per
        `sync.ahead_req_ids`; `rows` may be empty) to the shared tokens, then the write
        of the tokens flag. Where the rows are `start`, `start + 1`, ... (the usual
        step) both go on the side stream, behind the work queued so far on the current
        one, so the forward queued next does not wait for them; otherwise the rows are
        gathered on the current stream first."""
        if self._side is None:
            self._side = (torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event())
        side, handed, _ = self._side
        k = len(rows)
        if start is not None:
            handed.record()
            side.wait_event(handed)
            if k:
                stream_ops.copy_to_host(sync.tokens[:k], sampled[start : start + k], side)
            stream_ops.write_value(self._flag(sync, TOKENS_FLAG), sync.seq, side)
            return
        if k:
            if len(self._gathered) < k or self._gathered.device != sampled.device:
                self._gathered = torch.empty(len(sampled), dtype=torch.int64, device=sampled.device)
            gathered = self._gathered[:k]
            torch.index_select(sampled, 0, rows, out=gathered)
            stream_ops.copy_to_host(sync.tokens[:k], gathered)
        stream_ops.write_value(self._flag(sync, TOKENS_FLAG), sync.seq)
        handed.record()

    def copy_when_filled(self, sync: GrammarSync, dst: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Queues on the side stream, behind the step's hand-over (`give_tokens`, queued
        before this), the wait for the step's bitmask and then its copy
        (`bitmask`, pinned) to `dst` on the device; the work queued next on the current
        stream waits for them, while the forward queued since the hand-over runs on."""
        if self._side is None:
            raise RuntimeError("copy_when_filled before any give_tokens")
        side, handed, filled = self._side
        side.wait_event(handed)
        stream_ops.wait_value(self._flag(sync, MASK_FLAG), sync.seq, side)
        stream_ops.copy_to_device(dst, bitmask, side)
        filled.record(side)
        torch.cuda.current_stream().wait_event(filled)

    def wait_for_masks(self, sync: GrammarSync) -> None:
        """Queues the current stream's wait for the step's bitmask (the work queued next
        runs once the grammar process has filled it)."""
        stream_ops.wait_value(self._flag(sync, MASK_FLAG), sync.seq)

    def wait_on_host(self, sync: GrammarSync) -> None:
        """Waits here until the grammar process has filled the step's bitmask (its flag;
        the manager's watchdog sets it if the process is lost)."""
        flags = sync.flags.numpy().view("uint32")
        while not flag_reached(int(flags[MASK_FLAG]), sync.seq):
            time.sleep(0.0001)
