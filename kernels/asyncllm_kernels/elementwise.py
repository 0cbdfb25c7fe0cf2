"""Row-wise kernels around attention: KV cache write, fused residual + RMSNorm, SiluAndMul.

Each has a plain-torch reference (`*_ref`) in reference.py that the tests compare
against. Launch grids depend only on tensor shapes, so the kernels can be captured in
CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm_kernels import pdl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    width: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding: nothing to write
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    k = tl.load(key_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_v + offs, mask=mask)
    tl.store(key_cache_ptr + slot * width + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * width + offs, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, H, D]; caches: [num_blocks, block_size, H, D]; slot < 0 is skipped."""
    T, H, D = key.shape
    width = H * D
    key2, value2 = key.reshape(T, width), value.reshape(T, width)
    if T == 0:
        return
    _reshape_and_cache_kernel[(T,)](
        key2,
        value2,
        key_cache,
        value_cache,
        slot_mapping,
        key2.stride(0),
        value2.stride(0),
        width,
        triton.next_power_of_2(width),
        **pdl.options(key2),
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_ptr.dtype.element_ty)  # the sum is rounded, as in the models
        tl.store(residual_ptr + row * n_cols + offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.math.rsqrt(var + eps)
    # Cast back before scaling, as the reference models do.
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) or, with a residual, norm(x + residual) with the residual updated in place
    to x + residual. x, residual: [rows, hidden], contiguous."""
    x = x.contiguous()
    rows, n = x.shape
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous tensor of x's shape {tuple(x.shape)}")
    out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n),
        **pdl.options(x),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * 2 * d + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * d + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for x: [rows, 2d]."""
    x = x.contiguous()
    rows, two_d = x.shape
    d = two_d // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, d, BLOCK=block, **pdl.options(x))
    return out
