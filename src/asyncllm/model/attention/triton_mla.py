"""MLA through the Triton kernels (`asyncllm_kernels.mla_decode`): the cache written by
`concat_and_cache_mla`, a decode batch by `mla_decode` over the paged latent cache (a
decode batch runs inside the model runner's CUDA graphs); prefill chunks take the
up-projected path of `mla.py`."""

from __future__ import annotations

import torch

from asyncllm.model.attention.mla import MLABackend, MLALayerSpec
from asyncllm_kernels.mla_decode import concat_and_cache_mla, mla_decode


class TritonMLABackend(MLABackend):
    name = "triton_mla"

    def write_cache(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        concat_and_cache_mla(
            kv_c.to(kv_cache.dtype), k_pe.to(kv_cache.dtype), kv_cache, slots.to(torch.int64)
        )

    def decode_latent(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        spec: MLALayerSpec,
    ) -> torch.Tensor:
        return mla_decode(
            q,
            kv_cache,
            block_table.to(torch.int32),
            seq_lens.to(torch.int32),
            spec.scale,
            spec.kv_lora_rank,
        )
