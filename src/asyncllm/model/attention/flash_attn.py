"""Paged attention through FlashAttention 4 (`flash-attn-4`, the CuTe-DSL implementation;
the optional extra `flash-attn`).

`flash_attn.cute.flash_attn_varlen_func` takes the step as it is: the queries back to
back with their offsets (`cu_seqlens_q`), each sequence's keys in the cache's pages
(`page_table`, the block table; `seqused_k`, the sequence lengths), causal with the
chunk aligned to the end of its keys. The Triton backend's cache layout is its paged
layout for K and for V (`[blocks, block_size, kv_heads, head_size]` each), so nothing is
converted and the step's K/V are written by the Triton launch (`write_kv_cache`).
Sliding windows and soft-caps pass through. On sm_90 its pages load by TMA only when a
page is one key tile (128 tokens at head size 128); at the default block size of 16 it
takes its gather path. It has no split-KV on sm_90, and no CUDA graphs here yet: an
engine on this backend runs every step eagerly. Its kernels compile on first use.
"""

from __future__ import annotations

import torch

from asyncllm.model.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from asyncllm.model.attention.triton_attn import (
    TritonAttentionMetadata,
    paged_metadata,
    write_kv_cache,
)


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn.cute import flash_attn_varlen_func  # (fails at start-up if missing)

        self._varlen = flash_attn_varlen_func

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
        md = metadata
        key_cache, value_cache = write_kv_cache(k, v, kv_cache, md.slot_mapping)
        window = (spec.sliding_window - 1, 0) if spec.sliding_window is not None else (None, None)
        T = md.num_tokens
        out, _ = self._varlen(
            q[:T],
            key_cache,
            value_cache,
            cu_seqlens_q=md.query_start_loc,
            seqused_k=md.seq_lens,
            max_seqlen_q=max(md.max_query_len, 1),
            page_table=md.block_table.contiguous(),
            softmax_scale=spec.scale,
            causal=True,
            window_size=window,
            softcap=float(spec.logits_soft_cap or 0.0),
        )
        if T == q.shape[0]:
            return out
        full = torch.zeros_like(q)
        full[:T] = out
        return full
