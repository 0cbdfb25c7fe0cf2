"""Full CUDA graphs of decode steps: the whole forward (attention included) and the LM
head, one graph per captured batch size; and, with speculative decoding on a backend
that runs query lengths above 1 inside a graph, one verification graph per captured
size up to the speculation limit: `size` requests of up to `query_len` tokens each
(the last token and its drafts), padded to `size * query_len` tokens.

Every graph reads the model runner's static input buffers (token ids, positions, slot
mapping, query start offsets, sequence lengths, block table; a verification graph also
the logit rows) and writes float32 logits into one shared output buffer, so graphs
hold no outputs of their own. They are captured largest (in tokens) first into one
memory pool: each graph's intermediates are free once its capture ends, and the next
(smaller) capture reuses them. Replays never overlap, so sharing is safe. The attention
launch plan (grid, KV splits, tile shapes) depends only on the padded batch shape,
fixed per graph; per-step values are read from device memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int]  # (sequences, query length: 1 for a decode graph)


class DecodeGraphs:
    def __init__(
        self, sizes: list[int], verify_sizes: list[int] | None = None, query_len: int = 1
    ) -> None:
        self.sizes = sorted(sizes)
        self.verify_sizes = sorted(verify_sizes or []) if query_len > 1 else []
        self.query_len = query_len
        self.keys: list[GraphKey] = [(s, 1) for s in self.sizes]
        self.keys += [(s, query_len) for s in self.verify_sizes]
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # the shared memory pool's handle, from the first capture
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # Device memory each graph's capture took (its warm-up included): the largest's
        # holds the pool's intermediates, a smaller one's mostly its executable.
        self.bytes_by_key: dict[GraphKey, int] = {}
        self.replays = 0
        self.verify_replays = 0  # (of those, verification graphs')

    def capture(
        self, prepare: Callable[[GraphKey], Any], forward: Callable[[GraphKey, Any], None]
    ) -> None:
        """`prepare(key)` fills the static inputs with an inert batch of `key` (sequences,
        query length) and returns its attention metadata (built outside the graph: a
        backend may plan on the host); `forward(key, metadata)` runs the model on them
        and writes the logits buffer."""
        t0 = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info()
        free = free_before
        for key in sorted(self.keys, key=lambda k: (k[0] * k[1], k[1]), reverse=True):
            metadata = prepare(key)
            forward(key, metadata)  # warm-up: compiles kernels, sizes workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                forward(key, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
            torch.cuda.synchronize()
            now = torch.cuda.mem_get_info()[0]
            self.bytes_by_key[key], free = free - now, now
        torch.cuda.synchronize()
        self.capture_seconds = time.monotonic() - t0
        torch.cuda.empty_cache()
        self.pool_bytes = free_before - torch.cuda.mem_get_info()[0]  # the pool and the graphs
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %s; verification of %d tokens per "
            "request, batch sizes %s) in %.1f s, %.1f MiB",
            len(self.keys),
            _span(self.sizes),
            self.query_len,
            _span(self.verify_sizes),
            self.capture_seconds,
            self.pool_bytes / 2**20,
        )

    def replay(self, size: int, query_len: int = 1) -> None:
        self.graphs[(size, query_len)].replay()
        self.replays += 1
        self.verify_replays += query_len > 1


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
