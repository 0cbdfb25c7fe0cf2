"""The model runner's side of a device step (step_io.GrammarSync): it queues, with the
step's launch, the copy of the tokens the grammar process needs and the write of their
flag, and before the sampling the device's wait for the bitmask's flag. The host waits
for neither (asyncllm_kernels/stream_ops.py)."""

from __future__ import annotations

import time

import torch

from asyncllm.step_io import MASK_FLAG, TOKENS_FLAG, GrammarSync, flag_reached
from asyncllm_kernels import stream_ops


class GrammarHandshake:
    def __init__(self) -> None:
        self._addresses: dict[int, int] = {}  # host address of the flags -> the device's

    def _flag(self, sync: GrammarSync, index: int) -> int:
        base = sync.flags.data_ptr()
        address = self._addresses.get(base)
        if address is None:
            address = self._addresses[base] = stream_ops.device_address(base)
        return address + 4 * index

    def give_tokens(self, sync: GrammarSync, tokens: torch.Tensor | None) -> None:
        """Queues the copy of `tokens` (on the device, one per `sync.ahead_req_ids`;
        None: there are none) to the shared tokens, then the tokens flag's write."""
        if tokens is not None and len(tokens):
            sync.tokens[: len(tokens)].copy_(tokens, non_blocking=True)
        stream_ops.write_value(self._flag(sync, TOKENS_FLAG), sync.seq)

    def wait_for_masks(self, sync: GrammarSync) -> None:
        """Queues the device's wait for the step's bitmask (the work queued next runs
        once the grammar process has filled it)."""
        stream_ops.wait_value(self._flag(sync, MASK_FLAG), sync.seq)

    def wait_on_host(self, sync: GrammarSync) -> None:
        """Waits here until the grammar process has filled the step's bitmask (its flag;
        the manager's watchdog sets it if the process is lost)."""
        flags = sync.flags.numpy().view("uint32")
        while not flag_reached(int(flags[MASK_FLAG]), sync.seq):
            time.sleep(0.0001)
