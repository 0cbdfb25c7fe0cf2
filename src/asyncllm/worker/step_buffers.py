"""The model runner's per-step input buffers, allocated once at their largest size.

Each buffer is a CPU tensor (pinned on CUDA) with a numpy view the runner fills, and a
device twin that the model reads. A step writes a prefix of each host buffer with
numpy and queues two copies to the device with `non_blocking=True` (the arena of the
small arrays, the block table's rows); nothing per step allocates device memory or
builds a tensor from a Python list. On the CPU the twin is the host tensor itself and
nothing is copied.

A CUDA-graph step is padded to a captured batch size: the padding tokens are written
nowhere (slot -1), padded sequences have an empty chunk (their `query_start_loc` repeats
the last offset) and no keys (`seq_lens` 0), so a replay with fewer real requests than
the captured size computes the same values for the real ones.

All of a step's small inputs are written in one go, before its copies are queued
(`copy_to_device`, then `step_queued`); the next step rewrites the pinned host buffers
only once those copies are done (`wait_until_writable`). With async scheduling the
device is then still running the previous step's kernels, but its input copies ran
before them. Buffers that are written while a step may still be reading them (the
sampling parameters) are not pinned: a copy from pageable memory is staged at once.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch


class HostDeviceBuffer:
    """A host tensor with its numpy view and a device twin of the same shape."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        pinned: bool = True,
    ) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda and pinned)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_device(self, n: int) -> torch.Tensor:
        """The first n rows on the device (queued, not waited for)."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class _ArenaView:
    """One typed array inside a `StepBuffers` arena: its host numpy view, host tensor and
    device tensor (fixed addresses, as CUDA graphs need)."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor) -> None:
        self.cpu = host
        self.np: np.ndarray = host.numpy()
        self.device = device


class StepBuffers:
    """Inputs of one step: T tokens of S sequences (T and S padded for graphs).

    The per-token arrays (input ids, positions, slot mapping) and the per-sequence ones
    (query start offsets, sequence lengths, the hidden-state rows whose logits are
    computed, the persistent-batch rows of the requests that sample, and where the
    tokens still being sampled by the step in flight go) are views into one pinned byte
    arena with one device twin, so a step sends them in a single copy of the whole
    arena (a few hundred KB at most, well under a launch's worth of host time); each
    tensor copy costs tens of µs of host time. The block table is copied on its own,
    only the rows in use. The slot mapping and the block table have one row per KV
    cache group (`model/kv_groups.py`)."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        num_groups: int = 1,
        max_logit_rows: int | None = None,
    ) -> None:
        """`max_logit_rows`: the most rows a step samples (more than max_num_seqs where
        requests verify draft tokens: one row per position)."""
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        max_logit_rows = max_logit_rows or max_num_seqs
        on_cuda = device.type == "cuda"
        layout: list[tuple[str, int, torch.dtype]] = [
            ("input_ids", max_num_tokens, torch.int64),
            ("positions", max_num_tokens, torch.int64),
            ("slot_mapping", num_groups * max_num_tokens, torch.int64),
            ("query_start_loc", max_num_seqs + 1, torch.int32),
            ("seq_lens", max_num_seqs, torch.int32),
            ("logit_rows", max_logit_rows, torch.int64),
            ("sample_rows", max_logit_rows, torch.int64),
            ("pending_at", max_num_seqs, torch.int64),
            ("pending_rows", max_num_seqs, torch.int64),
            ("grammar_rows", max_num_seqs, torch.int64),
        ]
        offsets, nbytes = [], 0
        for _, n, dtype in layout:
            offsets.append(nbytes)
            nbytes += -(-(n * dtype.itemsize) // 8) * 8  # every view 8-byte aligned
        self.host_arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_arena = (
            torch.zeros(nbytes, dtype=torch.uint8, device=device) if on_cuda else self.host_arena
        )
        views = {}
        for (name, n, dtype), off in zip(layout, offsets):
            size = n * dtype.itemsize
            views[name] = _ArenaView(
                self.host_arena[off : off + size].view(dtype),
                self.device_arena[off : off + size].view(dtype),
            )
        self.input_ids = views["input_ids"]
        self.positions = views["positions"]
        # [KV cache group, token]
        self.slot_mapping = _ArenaView(
            views["slot_mapping"].cpu.view(num_groups, max_num_tokens),
            views["slot_mapping"].device.view(num_groups, max_num_tokens),
        )
        self.query_start_loc = views["query_start_loc"]
        self.seq_lens = views["seq_lens"]
        self.logit_rows = views["logit_rows"]
        self.sample_rows = views["sample_rows"]
        self.pending_at = views["pending_at"]  # token index in the step
        self.pending_rows = views["pending_rows"]  # the persistent row it comes from
        # a device step's: the rows whose last tokens go to the grammar process
        self.grammar_rows = views["grammar_rows"]
        # [KV cache group, sequence, block]
        self.block_table = HostDeviceBuffer(
            (num_groups, max_num_seqs, max_blocks), torch.int32, device
        )
        self._copies_done = torch.cuda.Event() if on_cuda else None

    def step_queued(self) -> None:
        """Marks the end of a step's copies from these buffers."""
        if self._copies_done is not None:
            self._copies_done.record()

    def wait_until_writable(self) -> None:
        """Waits until the last step's copies have left the pinned host buffers, so they can
        be rewritten (they run before that step's kernels, so this is short)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()

    def pad(self, num_tokens: int, num_seqs: int, padded_tokens: int, padded_seqs: int) -> None:
        """Makes tokens [num_tokens, padded_tokens) and sequences [num_seqs, padded_seqs)
        inert: no cache writes, empty chunks, no keys."""
        if padded_tokens > num_tokens:
            self.input_ids.np[num_tokens:padded_tokens] = 0
            self.positions.np[num_tokens:padded_tokens] = 0
            self.slot_mapping.np[:, num_tokens:padded_tokens] = -1
        if padded_seqs > num_seqs:
            qsl = self.query_start_loc.np
            qsl[num_seqs + 1 : padded_seqs + 1] = qsl[num_seqs]
            self.seq_lens.np[num_seqs:padded_seqs] = 0
            self.block_table.np[:, num_seqs:padded_seqs] = 0

    def copy_to_device(self, num_seqs: int) -> None:
        """Queues the step's inputs for the device: the arena (one copy, whole) and the
        block table's first `num_seqs` rows."""
        if self.device_arena is not self.host_arena:
            self.device_arena.copy_(self.host_arena, non_blocking=True)
        bt = self.block_table
        if bt.device is not bt.cpu:
            bt.device[:, :num_seqs].copy_(bt.cpu[:, :num_seqs], non_blocking=True)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of the sorted `sizes` that holds n, or None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
