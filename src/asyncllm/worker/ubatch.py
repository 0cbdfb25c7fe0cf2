"""Micro-batches: a step the model runs eagerly, split into parts of whole requests.

A step with large prefill chunks is compute-bound; split in two, one part's GEMMs can
run while the other's attention does (NanoFlow's idea), each part's layers queued on a
CUDA stream of its own. A part is a run of whole requests (its tokens, positions, block
tables and KV slots are a slice of the step buffers); the parts' hidden states are put
back together in batch order, so the logits and sampling do not change. A step of
one-token decodes is never split, graphed or not (memory-bound: split, it would read
the weights twice), nor one where a part reads KV blocks another part writes in that
step (`parts_independent`). A backend whose step plan is one shared object (FlashInfer's
wrappers: `AttentionBackend.streams_safe` False) refuses micro-batches at start-up.
The memory profile runs one split step (its parts' allocations come from separate
stream pools).

`EngineArgs.ubatch`: N splits every eager step of at least N requests into N parts;
"auto" only where `AUTO_MIN_TOKENS` holds a measured size from which two parts pay for
the model's shape (none yet: "auto" splits nothing until a measurement says it pays);
"off".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# (architecture, hidden size) -> the fewest tokens of a step from which two parts were
# measured faster than one (docs/benchmarks.md); shapes not listed are never split.
AUTO_MIN_TOKENS: dict[tuple[str, int], int] = {}


def split_requests(query_start_loc: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Up to `parts` runs of whole requests [(first, end), ...], in order, covering the
    step: each ends at the request boundary nearest its share of the tokens; no run is
    empty. `query_start_loc`: the step's [S + 1] token offsets."""
    S = len(query_start_loc) - 1
    total = int(query_start_loc[-1])
    parts = min(parts, S)
    bounds = [0]
    for i in range(1, parts):
        lo, hi = bounds[-1] + 1, S - (parts - i)  # (a request left for each run after)
        candidates = np.arange(lo, hi + 1)
        target = total * i / parts
        bounds.append(int(candidates[np.abs(query_start_loc[candidates] - target).argmin()]))
    bounds.append(S)
    return list(zip(bounds, bounds[1:]))


class MicroBatches:
    """Decides each eager step's split (`plan`) and runs the parts (`run`)."""

    def __init__(self, setting: str | int, architecture: str, hidden: int, device: torch.device):
        self.parts = setting if isinstance(setting, int) else 0
        self.min_tokens = 0
        if setting == "auto" and (architecture, hidden) in AUTO_MIN_TOKENS:
            self.parts, self.min_tokens = 2, AUTO_MIN_TOKENS[(architecture, hidden)]
        self.streams: list[torch.cuda.Stream] = []
        if self.parts and device.type == "cuda":
            self.streams = [torch.cuda.Stream(device) for _ in range(self.parts)]

    def plan(self, query_start_loc: np.ndarray) -> list[tuple[int, int]] | None:
        """The step's parts, or None to run it whole."""
        S = len(query_start_loc) - 1
        T = int(query_start_loc[-1])
        if not self.parts or S < self.parts or T < self.min_tokens or T == S:
            return None  # (T == S: one-token decodes, memory-bound: never split)
        return split_requests(query_start_loc, self.parts)

    def run(
        self, parts: list[tuple[int, int]], forward_part: Callable[[int, int], torch.Tensor]
    ) -> torch.Tensor:
        """Each part's forward (`forward_part(first, end)`: its hidden states), on its
        own stream on CUDA (each waits for what the step queued before it; the step's
        stream then waits for every part), concatenated in order."""
        if not self.streams:
            return torch.cat([forward_part(a, b) for a, b in parts])
        main = torch.cuda.current_stream()
        outs = []
        for (a, b), stream in zip(parts, self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                outs.append(forward_part(a, b))
        for out, stream in zip(outs, self.streams):
            main.wait_stream(stream)
            out.record_stream(main)  # (made on the part's stream, read on the step's)
        return torch.cat(outs)


def parts_independent(
    parts: list[tuple[int, int]],
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
) -> bool:
    """Whether no request reads, as its context, a KV block that a request of another
    part writes in this step (a prefix-cache hit on blocks computed in the same step):
    parts on separate streams would race on it, so such a step runs whole.
    `block_tables`: [groups, S, blocks]; `slot_mapping`: [groups, T]."""
    S = parts[-1][1] if parts else 0
    part_of_seq = np.zeros(S, dtype=np.int64)
    for i, (a, b) in enumerate(parts):
        part_of_seq[a:b] = i
    part_of_token = np.repeat(part_of_seq, np.diff(query_start_loc[: S + 1]))
    context = seq_lens[:S].astype(np.int64) - np.diff(query_start_loc[: S + 1])
    for g in range(block_tables.shape[0]):
        slots = slot_mapping[g, : len(part_of_token)]
        written = slots >= 0
        blocks, writers = slots[written] // block_size, part_of_token[written]
        for s in range(S):
            read = block_tables[g, s, : -(-int(context[s]) // block_size)]
            hit = np.isin(blocks, read)
            if hit.any() and (writers[hit] != part_of_seq[s]).any():
                return False
    return True
