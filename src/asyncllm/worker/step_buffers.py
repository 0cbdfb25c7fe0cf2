"""The model runner's per-step input buffers, allocated once at their largest size.

Each buffer is a CPU tensor (pinned on CUDA) with a numpy view the runner fills, and a
device twin that the model reads. A step writes a prefix of each host buffer with
numpy and copies that prefix to the device with `non_blocking=True`; nothing per step
allocates device memory or builds a tensor from a Python list. On the CPU the twin is
the host tensor itself and nothing is copied.

A CUDA-graph step is padded to a captured batch size: the padding tokens are written
nowhere (slot -1), padded sequences have an empty chunk (their `query_start_loc` repeats
the last offset) and no keys (`seq_lens` 0), so a replay with fewer real requests than
the captured size computes the same values for the real ones.

The pinned host buffers are rewritten by the next step; that is safe because every step
waits for its sampled ids (a device sync after the copies were queued).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch


class HostDeviceBuffer:
    """A host tensor with its numpy view and a device twin of the same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_device(self, n: int) -> torch.Tensor:
        """The first n rows on the device (queued, not waited for)."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class StepBuffers:
    """Inputs of one step: T tokens of S sequences (T and S padded for graphs)."""

    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device
    ) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.input_ids = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.positions = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = HostDeviceBuffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = HostDeviceBuffer((max_num_seqs,), torch.int32, device)
        self.block_table = HostDeviceBuffer((max_num_seqs, max_blocks), torch.int32, device)
        self.sample_rows = HostDeviceBuffer((max_num_seqs,), torch.int64, device)

    def pad(self, num_tokens: int, num_seqs: int, padded_tokens: int, padded_seqs: int) -> None:
        """Makes tokens [num_tokens, padded_tokens) and sequences [num_seqs, padded_seqs)
        inert: no cache writes, empty chunks, no keys."""
        if padded_tokens > num_tokens:
            self.input_ids.np[num_tokens:padded_tokens] = 0
            self.positions.np[num_tokens:padded_tokens] = 0
            self.slot_mapping.np[num_tokens:padded_tokens] = -1
        if padded_seqs > num_seqs:
            qsl = self.query_start_loc.np
            qsl[num_seqs + 1 : padded_seqs + 1] = qsl[num_seqs]
            self.seq_lens.np[num_seqs:padded_seqs] = 0
            self.block_table.np[num_seqs:padded_seqs] = 0

    def copy_to_device(self, num_tokens: int, num_seqs: int) -> None:
        for buf in (self.input_ids, self.positions, self.slot_mapping):
            buf.copy_to_device(num_tokens)
        self.query_start_loc.copy_to_device(num_seqs + 1)
        self.seq_lens.copy_to_device(num_seqs)
        self.block_table.copy_to_device(num_seqs)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of the sorted `sizes` that holds n, or None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
