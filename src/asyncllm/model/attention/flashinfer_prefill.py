"""Triton for decodes, FlashInfer for prefill chunks: one engine, two libraries.

On one H100 the Triton kernel decodes as fast as FlashInfer or faster (batch 1: 9.6
against 12.4 µs a layer at 1k keys; a mixed step 472 against 617 µs), while FlashInfer's
prefill runs causal chunks at 492 TFLOP/s against Triton's 308 (a 12,000-token prompt's
step: 30 against 49 ms of attention on the Qwen3-0.6B shape; docs/benchmarks.md). This
backend gives each kernel its part of a step: the one-token sequences to Triton's
decode launch (`paged_attention(rows="decodes")`), the longer chunks to FlashInfer's
paged prefill wrapper, planned on the host over those sequences alone; their query rows
are gathered and their outputs put back in batch order. Both read the same cache, the
Triton backend's layout (K and V written once, `write_kv_cache`). Decode-only steps and
the decode graphs are Triton's alone, so nothing is planned before a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.model.attention.backend import (
    AttentionLayerSpec,
    CommonAttentionMetadata,
    numpy_to_device,
)
from asyncllm.model.attention.flashinfer import FlashInferBackend, FlashInferMetadata, PagedBatch
from asyncllm.model.attention.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    write_kv_cache,
)
from asyncllm_kernels.paged_attention import paged_attention


def chunk_tokens(query_start_loc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the sequences whose chunk is longer than one token, their tokens' rows in the
    batch), from a batch's query offsets."""
    lens = np.diff(query_start_loc)
    seqs = np.flatnonzero(lens > 1)
    if not len(seqs):
        return seqs, np.zeros(0, dtype=np.int64)
    rows = np.concatenate([np.arange(query_start_loc[s], query_start_loc[s + 1]) for s in seqs])
    return seqs, rows.astype(np.int64)


@dataclass
class SplitMetadata:
    triton: TritonAttentionMetadata  # the whole batch (its decodes run on it)
    prefill: FlashInferMetadata | None  # the chunks alone; None: a decode-only batch
    chunk_rows: torch.Tensor | None  # [chunk tokens] their rows in the batch
    has_decodes: bool


class FlashInferPrefillBackend(TritonAttentionBackend):
    name = "flashinfer_prefill"
    streams_safe = False  # (FlashInfer's prefill wrapper and workspace are shared)

    def __init__(self) -> None:
        super().__init__()
        self._flashinfer = FlashInferBackend()  # (fails here if FlashInfer is missing)

    def build_metadata(  # type: ignore[override]
        self, common: CommonAttentionMetadata, block_size: int
    ) -> SplitMetadata:
        triton = super().build_metadata(common, block_size)
        if common.max_query_len <= 1 or common.for_cuda_graph:
            return SplitMetadata(triton, None, None, True)
        if common.block_table_cpu is None:
            raise ValueError("the flashinfer_prefill backend needs the block table on the host")
        qsl = common.query_start_loc_cpu
        seqs, rows = chunk_tokens(qsl)
        lens = np.diff(qsl)[seqs]
        sub_qsl = np.concatenate([[0], np.cumsum(lens)])
        batch = PagedBatch.from_arrays(
            sub_qsl, common.seq_lens_cpu[seqs], common.block_table_cpu[seqs], block_size
        )
        prefill = FlashInferMetadata(
            decode=False,
            group=common.kv_group,
            for_cuda_graph=False,
            batch=batch,
            block_size=block_size,
            width=common.block_table_cpu.shape[1],
            slot_mapping=triton.slot_mapping,
            num_tokens=len(rows),
        )
        device = common.query_start_loc.device
        has_decodes = bool((np.diff(qsl) == 1).any())
        return SplitMetadata(triton, prefill, numpy_to_device(rows, device), has_decodes)

    def forward(  # type: ignore[override]
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: SplitMetadata,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.triton.slot_mapping)
        return self.forward_cached(spec, q, kv_cache, metadata)

    def fused_kv_slots(self, metadata: SplitMetadata) -> torch.Tensor | None:  # type: ignore[override]
        return super().fused_kv_slots(metadata.triton)

    def forward_cached(  # type: ignore[override]
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: SplitMetadata,
    ) -> torch.Tensor:
        md = metadata
        if md.prefill is None or md.chunk_rows is None:
            return super().forward_cached(spec, q, kv_cache, md.triton)
        t = md.triton
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        if md.has_decodes:
            paged_attention(
                q, key_cache, value_cache, t.block_table, t.seq_lens, t.query_start_loc,
                spec.scale, max_query_len=t.max_query_len, has_decodes=True,
                sliding_window=spec.sliding_window, soft_cap=spec.logits_soft_cap,
                out=out, rows="decodes",
            )  # fmt: skip
        wrapper = self._flashinfer.planned_wrapper(md.prefill, spec, q, key_cache.dtype)
        chunks = wrapper.run(q.index_select(0, md.chunk_rows), (key_cache, value_cache))
        out.index_copy_(0, md.chunk_rows, chunks)
        return out
