"""Paged attention through the Triton kernels: the default on CUDA.

Per layer, two launches: `reshape_and_cache` writes the step's K/V into the paged
cache (or the layer's rotary launch does, `fused_kv_slots`), then one `paged_attention`
launch (plus a merge launch when the keys are split) covers the whole batch, prefill
chunks and decodes alike. The metadata is the device tensors of `CommonAttentionMetadata`
as they are; nothing per step is a Python value inside a launch; the host only picks
tile shapes (decode-only, chunks of at most SHORT_QUERY tokens such as a speculative
verification's, or longer) and, for a batch that mixes decodes with longer chunks,
makes that two launches.

Its warm-up compiles, at start-up, the launches only steps that mix one-token decodes
with a prefill chunk use: one inert mixed batch per launch config such a step can meet,
with a short chunk and with a long one (~2.7 s on an H200 with a cold Triton cache for
the long ones alone, measured before the short ones were added; in the first mixed step
otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm import envs
from asyncllm.model.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionWarmUp,
    CommonAttentionMetadata,
)
from asyncllm_kernels.elementwise import reshape_and_cache
from asyncllm_kernels.paged_attention import (
    SHORT_QUERY,
    choose_config,
    paged_attention,
    short_launch,
)


def mixed_warm_up_sizes(ctx: AttentionWarmUp) -> list[tuple[int, int]]:
    """One (sequences, chunk tokens) batch per launch config of a mixed step: a chunk of
    up to SHORT_QUERY tokens beside decodes, or alone, is one launch of short tiles
    (where `short_launch` says so); a longer one beside decodes is two launches, and
    only the decodes' config depends on the batch."""
    shapes: dict[Any, tuple[int, int]] = {}  # (launch config, chunk) -> the first batch
    chunks = [SHORT_QUERY + 1] + ([2] if short_launch(2, ctx.group) else [])
    for num_seqs in range(1, ctx.max_mixed_seqs + 1):
        for chunk in chunks:
            alone = num_seqs == 1 and chunk > SHORT_QUERY  # the prefill launch (profiled)
            if alone or num_seqs - 1 + chunk > ctx.max_batched_tokens:
                continue
            cfg = choose_config(
                num_seqs, ctx.num_kv_heads, ctx.group, ctx.head_size, True, ctx.device,
                ctx.dtype, query_len=2 if chunk == 2 else 1,
            )  # fmt: skip
            shapes.setdefault((cfg, chunk), (num_seqs, chunk))
    return list(shapes.values())


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the step's K/V (its first len(slot_mapping) rows; a negative slot is not
    written) into a (2, blocks, block_size, kv_heads, head_size) cache, one launch;
    returns the key and value caches."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    n = slot_mapping.shape[0]
    reshape_and_cache(
        k[:n].to(key_cache.dtype), v[:n].to(value_cache.dtype), key_cache, value_cache,
        slot_mapping,
    )  # fmt: skip
    return key_cache, value_cache


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, negative: not written
    max_query_len: int
    has_decodes: bool  # some chunk is one token (with longer ones: two launches)
    num_tokens: int  # tokens with a query (any after them in q are padding)


def paged_metadata(common: CommonAttentionMetadata) -> TritonAttentionMetadata:
    """The step's device tensors in the dtypes the paged kernels take (the Triton and
    FlashAttention backends' metadata)."""
    return TritonAttentionMetadata(
        query_start_loc=common.query_start_loc.to(torch.int32),
        seq_lens=common.seq_lens.to(torch.int32),
        block_table=common.block_table.to(torch.int32),
        slot_mapping=common.slot_mapping.to(torch.int64),
        max_query_len=common.max_query_len,
        has_decodes=bool((np.diff(common.query_start_loc_cpu) == 1).any()),
        num_tokens=common.num_actual_tokens,
    )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._fused_kv_write = envs.fused_kv_write()

    def warm_up(self, ctx: AttentionWarmUp) -> int:
        """Eager forwards of inert mixed batches, one per decode-launch config (on CUDA:
        the interpreter compiles nothing)."""
        if ctx.device.type != "cuda":
            return 0
        sizes = mixed_warm_up_sizes(ctx)
        for num_seqs, chunk in sizes:
            ctx.run_mixed_batch(num_seqs, chunk)
        return len(sizes)

    def build_metadata(
        self, common: CommonAttentionMetadata, block_size: int
    ) -> TritonAttentionMetadata:
        return paged_metadata(common)

    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
        return self.forward_cached(spec, q, kv_cache, metadata)

    def fused_kv_slots(self, metadata: TritonAttentionMetadata) -> torch.Tensor | None:
        return metadata.slot_mapping if self._fused_kv_write else None

    def forward_cached(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        md = metadata
        return paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            spec.scale,
            max_query_len=md.max_query_len,
            has_decodes=md.has_decodes,
            sliding_window=spec.sliding_window,
            soft_cap=spec.logits_soft_cap,
        )
