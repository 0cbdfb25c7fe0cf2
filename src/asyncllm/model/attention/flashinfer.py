"""Paged attention through FlashInfer's wrappers (the optional extra `flashinfer`).

The KV cache is the Triton backend's layout, (2, blocks, block_size, kv_heads,
head_size): K and V are passed to FlashInfer as a tuple of two NHD page tables, so
nothing is converted and the step's K/V are written by the same launch
(`triton_attn.write_kv_cache`). FlashInfer wants the block table as CSR (page index pointers, the pages, the
last page's fill), which `build_metadata` computes on the host from the runner's host
block table.

A batch of one-token decodes runs the decode wrapper (tensor cores when a KV head
serves more than 4 query heads); any other batch runs the prefill wrapper, causal, over
all of it (one-token rows included). FlashInfer plans a batch on the host before it
runs it (work split, tile indices); the plan depends on the layer's heads, head size,
scale, window and soft-cap, which the first layer of a KV cache group to run brings,
and every later layer of the group must share. A decode graph has a wrapper of its own
per captured size and group, over fixed buffers (`use_cuda_graph=True`): the runner
builds the metadata before each replay (`plans_on_host`), which plans into them again.

First use compiles FlashInfer's kernels for the shape with the machine's nvcc (about
20 s for decode and 80 s for prefill on a 16-core machine), cached under
`FLASHINFER_WORKSPACE_BASE` (default: ~/.cache/flashinfer) for later runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm.model.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    CommonAttentionMetadata,
)
from asyncllm.model.attention.triton_attn import write_kv_cache

WORKSPACE_BYTES = 256 << 20  # split-KV partial results, shared by every wrapper
INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's own size for a wrapper's plan data
TENSOR_CORE_DECODE_GROUP = 4  # query heads per KV head above which decode uses them

PlanKey = tuple[int, int, int, float, int, float, torch.dtype, torch.dtype]


def plan_key(spec: AttentionLayerSpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> PlanKey:
    """What a plan depends on: heads, head size, scale, window, soft-cap and dtypes."""
    window = spec.sliding_window - 1 if spec.sliding_window is not None else -1
    cap = float(spec.logits_soft_cap or 0.0)
    return (
        spec.num_heads, spec.num_kv_heads, spec.head_size, float(spec.scale), window, cap,
        q_dtype, kv_dtype,
    )  # fmt: skip


@dataclass
class PagedBatch:
    """One batch's KV pages as FlashInfer reads them (int32 host tensors)."""

    qo_indptr: torch.Tensor  # [S + 1]
    kv_indptr: torch.Tensor  # [S + 1]
    kv_indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [S]

    @classmethod
    def of(cls, common: CommonAttentionMetadata, block_size: int) -> PagedBatch:
        """From the host arrays. A sequence with no keys (a graph's padding row) reads
        one key of its row's first block (the runner pads with block 0), so that every
        row is well defined; its output is unused."""
        if common.block_table_cpu is None:
            raise ValueError("the flashinfer backend needs the block table on the host")
        return cls.from_arrays(
            common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table_cpu, block_size
        )

    @classmethod
    def from_arrays(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
    ) -> PagedBatch:
        """`of`, from the host arrays themselves (or a subset of a batch's sequences, its
        query offsets starting at 0)."""
        seq_lens = np.maximum(seq_lens.astype(np.int64), 1)
        pages = -(-seq_lens // block_size)
        table = block_table[:, : int(pages.max(initial=0))]
        in_use = np.arange(table.shape[1])[None, :] < pages[:, None]
        kv_indptr = np.zeros(len(pages) + 1, dtype=np.int32)
        np.cumsum(pages, out=kv_indptr[1:])
        last = seq_lens - (pages - 1) * block_size
        return cls(
            qo_indptr=torch.from_numpy(query_start_loc.astype(np.int32)),
            kv_indptr=torch.from_numpy(kv_indptr),
            kv_indices=torch.from_numpy(np.ascontiguousarray(table[in_use], dtype=np.int32)),
            last_page_len=torch.from_numpy(last.astype(np.int32)),
        )


@dataclass
class FlashInferMetadata:
    decode: bool  # a batch of one-token decodes (the decode wrapper)
    group: int  # its KV cache group
    for_cuda_graph: bool  # a decode graph's batch (its own wrapper over fixed buffers)
    batch: PagedBatch
    block_size: int
    width: int  # the block table's width (a graph wrapper's page buffer: size x width)
    slot_mapping: torch.Tensor  # [T] int64, negative: not written
    num_tokens: int  # the step's tokens (a graph's padding included)
    planned: PlanKey | None = None
    wrapper: Any = None  # set by the plan


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    plans_on_host = True
    streams_safe = False  # (one wrapper per group and one workspace, planned per step)

    def __init__(self) -> None:
        import flashinfer  # noqa: F401  (fails here, at start-up, if it is not installed)

        self._workspace: torch.Tensor | None = None
        self._eager: dict[tuple[str, int, bool], Any] = {}  # (kind, group, tensor cores)
        self._graphs: dict[tuple[int, int], Any] = {}  # (group, size) -> decode wrapper
        self._graph_keys: dict[tuple[int, int], PlanKey] = {}  # what each was captured with
        self._graph_int_workspace: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- wrappers ----------------------------------------------------------------------

    def _float_workspace(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _wrapper(self, md: FlashInferMetadata, key: PlanKey, device: torch.device) -> Any:
        """The wrapper to plan `md` with `key` on: a decode graph's own (one per group
        and size; the graphs of one group share one plan workspace, since one replays at
        a time, planned just before), else the group's eager decode or prefill one."""
        import flashinfer

        tensor_cores = key[0] // key[1] > TENSOR_CORE_DECODE_GROUP
        ws = self._float_workspace(device)
        if md.decode and md.for_cuda_graph:
            S = len(md.batch.last_page_len)
            if (md.group, S) not in self._graphs:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=tensor_cores,
                    paged_kv_indptr_buffer=torch.zeros(S + 1, dtype=torch.int32, device=device),
                    paged_kv_indices_buffer=torch.zeros(
                        S * md.width, dtype=torch.int32, device=device
                    ),
                    paged_kv_last_page_len_buffer=torch.zeros(S, dtype=torch.int32, device=device),
                )
                shared = self._graph_int_workspace.setdefault(
                    md.group,
                    (wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer),
                )
                wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer = shared
                self._graphs[(md.group, S)] = wrapper
            return self._graphs[(md.group, S)]
        kind = "decode" if md.decode else "prefill"
        wkey = (kind, md.group, tensor_cores and md.decode)
        if wkey not in self._eager:
            if md.decode:
                self._eager[wkey] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=tensor_cores
                )
            else:
                self._eager[wkey] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        return self._eager[wkey]

    # -- the backend -------------------------------------------------------------------

    def build_metadata(
        self, common: CommonAttentionMetadata, block_size: int
    ) -> FlashInferMetadata:
        S, T = common.num_seqs, int(common.slot_mapping.shape[0])
        assert common.block_table_cpu is not None or S == 0
        decode = common.max_query_len <= 1 and T == S and S > 0
        md = FlashInferMetadata(
            decode=decode,
            group=common.kv_group,
            for_cuda_graph=common.for_cuda_graph,
            batch=PagedBatch.of(common, block_size),
            block_size=block_size,
            width=common.block_table_cpu.shape[1] if common.block_table_cpu is not None else 1,
            slot_mapping=common.slot_mapping.to(torch.int64),
            num_tokens=T,
        )
        captured = self._graph_keys.get((md.group, S)) if decode and md.for_cuda_graph else None
        if captured is not None:
            # A replay runs no Python: plan now, into the buffers its capture read.
            self.plan(md, captured, common.seq_lens.device)
        return md

    def plan(self, md: FlashInferMetadata, key: PlanKey, device: torch.device) -> None:
        """Plans `md` (on its wrapper) for layers of `key`; once per step and KV group."""
        heads, kv_heads, head_size, scale, window, cap, q_dtype, kv_dtype = key
        md.wrapper = self._wrapper(md, key, device)
        b = md.batch
        if md.decode:
            md.wrapper.plan(
                b.kv_indptr, b.kv_indices, b.last_page_len, heads, kv_heads, head_size,
                md.block_size, window_left=window, logits_soft_cap=cap or None,
                q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale,
            )  # fmt: skip
        else:
            md.wrapper.plan(
                b.qo_indptr, b.kv_indptr, b.kv_indices, b.last_page_len, heads, kv_heads,
                head_size, md.block_size, causal=True, sm_scale=scale, window_left=window,
                logits_soft_cap=cap or None, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )  # fmt: skip
        md.planned = key
        if md.decode and md.for_cuda_graph:
            self._graph_keys[(md.group, len(b.last_page_len))] = key

    def planned_wrapper(
        self,
        md: FlashInferMetadata,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        kv_dtype: torch.dtype,
    ) -> Any:
        """The wrapper `md` runs on, planned by the first layer of its group to run (outside
        any graph capture: a capture's metadata was planned by the eager forward before
        it); a later layer of the group must share that plan."""
        key = plan_key(spec, q.dtype, kv_dtype)
        if md.planned is None:
            self.plan(md, key, q.device)
        elif md.planned != key:
            raise ValueError(
                "the flashinfer backend plans once per KV cache group, and the layers of "
                f"one group differ (heads, head size, scale, window, soft-cap): {md.planned} "
                f"and {key}"
            )
        return md.wrapper

    def forward(
        self,
        spec: AttentionLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        md = metadata
        key_cache, value_cache = write_kv_cache(k, v, kv_cache, md.slot_mapping)
        wrapper = self.planned_wrapper(md, spec, q, key_cache.dtype)
        tokens = md.num_tokens if md.decode else int(md.batch.qo_indptr[-1])
        out = wrapper.run(q[:tokens], (key_cache, value_cache))
        if tokens == q.shape[0]:
            return out
        full = torch.zeros_like(q)
        full[:tokens] = out
        return full
