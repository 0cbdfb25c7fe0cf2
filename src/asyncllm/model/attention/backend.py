"""The attention backend interface: KV cache layout, per-step metadata, forward.

A step's tokens form one flat batch of query chunks, one per sequence: a decode is a
chunk of one token, a prefill chunk may follow tokens already in the cache. The
model runner describes the batch once per step in `CommonAttentionMetadata`; each
backend's builder turns that into whatever its kernels want, shared by all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def numpy_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. On CUDA the copy is queued from pinned memory, so the
    host does not wait for the stream (the host allocator keeps the pinned copy until
    the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass
class CommonAttentionMetadata:
    """One step's batch, as every backend needs it.

    query_start_loc: [num_seqs + 1] offsets of each sequence's chunk in the flat batch.
    seq_lens: [num_seqs] tokens in the cache after this step (context + chunk).
    block_table: [num_seqs, max_blocks] KV block ids per sequence (padding is ignored).
    slot_mapping: [num_tokens] cache slot (block * block_size + offset) of each new
        token; a negative slot means "do not write" (padding).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    # The block table on the host (a backend that plans on the host reads it), this
    # batch's KV cache group, and whether the batch is a decode graph's (captured or
    # replayed: padded to the graph's size, its tensors at fixed addresses).
    block_table_cpu: np.ndarray | None = None
    kv_group: int = 0
    for_cuda_graph: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def from_numpy(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        slot_mapping: np.ndarray,
        device: torch.device | str,
    ) -> CommonAttentionMetadata:
        """Copies host arrays to the device (asynchronously from pinned memory on CUDA)."""
        dev = torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            return numpy_to_device(a, dev)

        query_lens = np.diff(query_start_loc)
        return cls(
            query_start_loc=put(query_start_loc),
            seq_lens=put(seq_lens),
            block_table=put(block_table),
            slot_mapping=put(slot_mapping),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max()) if len(query_lens) else 0,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
            block_table_cpu=block_table,
        )

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> CommonAttentionMetadata:
        """Builds the metadata from plain lists (tests, simple runners)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        sl = np.asarray(seq_lens, dtype=np.int32)
        width = max((len(b) for b in block_tables), default=0) or 1
        bt = np.zeros((len(block_tables), width), dtype=np.int32)
        slots = []
        for i, (blocks, q, s) in enumerate(zip(block_tables, query_lens, seq_lens)):
            if s > len(blocks) * block_size or q > s:
                raise ValueError(f"sequence {i}: {s} tokens do not fit {len(blocks)} blocks")
            bt[i, : len(blocks)] = blocks
            pos = np.arange(s - q, s)
            slots.append(bt[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        slot_mapping = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        return cls.from_numpy(qsl, sl, bt, slot_mapping, device)


@dataclass
class AttentionLayerSpec:
    """What a backend needs to know about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


@dataclass
class AttentionWarmUp:
    """What a backend's start-up warm-up (`AttentionBackend.warm_up`) knows of the model
    and may run: inert batches of the model runner, which write nothing to the KV cache."""

    device: torch.device
    dtype: torch.dtype
    num_kv_heads: int
    head_size: int
    group: int  # query heads per KV head
    max_mixed_seqs: int  # the most sequences a step mixing decodes with a chunk holds
    max_batched_tokens: int  # the most tokens a step holds
    # One eager forward of `n - 1` one-token decodes and a prefill chunk of `c` tokens.
    run_mixed_batch: Callable[[int, int], None]


class AttentionBackend(ABC):
    """One attention implementation. What it supports (devices, dtypes, features, CUDA
    graphs) is declared by its entry in `registry.py`, which names this class."""

    name: str = "abstract"
    # Whether its metadata is planned on the host into buffers a decode graph reads
    # (FlashInfer's plan): the runner then builds the metadata before every replay.
    plans_on_host: bool = False
    # Whether two parts of a step may run its forward on separate CUDA streams at once
    # (micro-batches): not where the step's plan or workspace is one shared object.
    streams_safe: bool = True

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """(2, num_blocks, block_size, num_kv_heads, head_size): K then V."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def warm_up(self, ctx: AttentionWarmUp) -> int:
        """Runs, at start-up after the KV cache exists, whatever this backend would
        otherwise compile in the middle of serving; returns the batches run. None here."""
        return 0

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata, block_size: int) -> Any:
        """Once per step; the result is passed to every layer's `forward`."""

    @abstractmethod
    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D]. Writes k/v into the cache, returns [T, Hq, D]."""

    def fused_kv_slots(self, metadata: Any) -> torch.Tensor | None:
        """Where a layer may write the step's K/V into this backend's cache itself, in
        the launch that rotates them (`RotaryEmbedding.into_kv_cache`): each token's
        int64 slot in the (2, blocks, block_size, kv_heads, head_size) cache (a negative
        one: not written), and the layer then calls `forward_cached`. None (here): the
        layer calls `forward`, which writes them."""
        return None

    def forward_cached(
        self, spec: AttentionLayerSpec, q: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """`forward` once the step's K/V are in the cache (see `fused_kv_slots`)."""
        raise NotImplementedError(f"the {self.name} backend writes its own KV cache")
