"""Full CUDA graphs of decode steps: the whole forward (attention included) and the LM
head, one graph per captured batch size.

Every graph reads the model runner's static input buffers (token ids, positions, slot
mapping, query start offsets, sequence lengths, block table) and writes float32 logits
into one shared output buffer, so graphs hold no outputs of their own. They are
captured largest first into one memory pool: each graph's intermediates are free once
its capture ends, and the next (smaller) capture reuses them. Replays never overlap, so
sharing is safe. The attention launch plan (grid, KV splits, tile shapes) depends only on
the padded batch size, fixed per graph; per-step values are read from device memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the shared memory pool's handle, from the first capture
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # Device memory each size's capture took (its warm-up included): the largest's
        # holds the pool's intermediates, a smaller one's mostly its executable.
        self.bytes_by_size: dict[int, int] = {}
        self.replays = 0

    def capture(self, prepare: Callable[[int], Any], forward: Callable[[int, Any], None]) -> None:
        """`prepare(size)` fills the static inputs with an inert batch of `size` and
        returns its attention metadata (built outside the graph: a backend may plan on
        the host); `forward(size, metadata)` runs the model on them and writes the
        logits buffer."""
        t0 = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info()
        free = free_before
        for size in reversed(self.sizes):
            metadata = prepare(size)
            forward(size, metadata)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                forward(size, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize()
            now = torch.cuda.mem_get_info()[0]
            self.bytes_by_size[size], free = free - now, now
        torch.cuda.synchronize()
        self.capture_seconds = time.monotonic() - t0
        torch.cuda.empty_cache()
        self.pool_bytes = free_before - torch.cuda.mem_get_info()[0]  # the pool and the graphs
        logger.info(
            "captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, %.1f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )

    def replay(self, size: int) -> None:
        self.graphs[size].replay()
        self.replays += 1
