"""The model runner's side of a device step (step_io.GrammarSync), on a side stream of
its own so the forward never waits for it: with the step's launch, the hand-over of the
tokens the grammar process needs (their gather, their copy and their flag's write); with
its sampling, the wait for the bitmask's flag and the bitmask's copy to the device
(`copy_when_filled`), which the sampling alone waits for. The host waits for none of it
(asyncllm_kernels/stream_ops.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync, flag_reached
from asyncllm_kernels import stream_ops


class GrammarHandshake:
    def __init__(self) -> None:
        self._addresses: dict[int, int] = {}  # host address of the flags -> the device's
        self._side: torch.cuda.Stream | None = None
        self._filled: torch.cuda.Event | None = None

    def _flag(self, sync: GrammarSync, index: int) -> int:
        base = sync.flags.data_ptr()
        address = self._addresses.get(base)
        if address is None:
            address = self._addresses[base] = stream_ops.device_address(base)
        return address + 4 * index

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream()
            self._filled = torch.cuda.Event()
        return self._side

    def give_tokens(self, sync: GrammarSync, sampled: torch.Tensor, rows: torch.Tensor) -> None:
        """Queues on the side stream, behind the work queued so far on the current one,
        the copy of `sampled[rows]` (on the device, one token per
        `sync.ahead_req_ids`; `rows` may be empty) to the shared tokens, then the write
        of the tokens flag. Work queued next on the current stream does not wait for it."""
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if len(rows):
                sync.tokens[: len(rows)].copy_(sampled.index_select(0, rows), non_blocking=True)
            stream_ops.write_value(self._flag(sync, TOKENS_FLAG), sync.seq, side)

    def copy_when_filled(self, sync: GrammarSync, copy: Callable[[], None]) -> None:
        """Queues on the side stream the wait for the step's bitmask, then `copy` (which
        queues its copy to the device), and makes the work queued next on the current
        stream wait for both: the forward queued before goes on meanwhile."""
        side = self._side_stream()
        assert self._filled is not None
        with torch.cuda.stream(side):
            stream_ops.wait_value(self._flag(sync, MASK_FLAG), sync.seq, side)
            copy()
            self._filled.record(side)
        torch.cuda.current_stream().wait_event(self._filled)

    def wait_for_masks(self, sync: GrammarSync) -> None:
        """Queues the current stream's wait for the step's bitmask (the work queued next
        runs once the grammar process has filled it), behind the hand-over."""
        current = torch.cuda.current_stream()
        if self._side is not None:
            current.wait_stream(self._side)
        stream_ops.wait_value(self._flag(sync, MASK_FLAG), sync.seq, current)

    def wait_on_host(self, sync: GrammarSync) -> None:
        """Waits here until the grammar process has filled the step's bitmask (its flag;
        the manager's watchdog sets it if the process is lost)."""
        flags = sync.flags.numpy().view("uint32")
        while not flag_reached(int(flags[MASK_FLAG]), sync.seq):
            time.sleep(0.0001)
