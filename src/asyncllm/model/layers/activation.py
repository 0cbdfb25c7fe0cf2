"""Gated activations."""

from __future__ import annotations

import torch

from asyncllm_kernels.reference import silu_and_mul_ref


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for the merged gate/up projection: one Triton kernel
    on CUDA, its plain-torch reference elsewhere (both in float32, one rounding)."""
    if x.is_cuda and x.dim() == 2:
        from asyncllm_kernels.elementwise import silu_and_mul as kernel

        return kernel(x)
    return silu_and_mul_ref(x)
