"""Rotary embedding applied to q and k in place, NeoX (halves) or GPT-J (pairs) layout.

The cos/sin table is [max_position, rotary_dim] float32: cos in the first half of each
row, sin in the second. Dimensions past rotary_dim are left alone (partial rotary).
The plain-torch reference is `apply_rotary_ref` in reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, offs, mask, rot_dim, IS_NEOX, BLOCK_H):
    h = tl.arange(0, BLOCK_H)
    ptr = base + h[:, None] * stride_h
    m = (h[:, None] < num_heads) & mask[None, :]
    if IS_NEOX:
        i1 = offs
        i2 = offs + rot_dim // 2
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    x1 = tl.load(ptr + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + i2[None, :], mask=m, other=0.0).to(tl.float32)
    out_ty = base.dtype.element_ty
    tl.store(ptr + i1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=m)
    tl.store(ptr + i2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=m)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads: tl.constexpr,
    num_k_heads: tl.constexpr,
    rot_dim: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    """One program per token: its cos/sin row is read once for all q and k heads."""
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, HALF)
    mask = offs < rot_dim // 2
    cos = tl.load(cache_ptr + pos * rot_dim + offs, mask=mask, other=1.0)
    sin = tl.load(cache_ptr + pos * rot_dim + rot_dim // 2 + offs, mask=mask, other=0.0)
    t = token.to(tl.int64)
    _rotate_heads(
        q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs, mask, rot_dim,
        IS_NEOX, BLOCK_HQ,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, offs, mask, rot_dim,
        IS_NEOX, BLOCK_HK,
    )  # fmt: skip


def apply_rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (last dim contiguous), rotated in place, one launch."""
    rot_dim = cos_sin_cache.shape[-1]
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"q has {T} tokens, k has {k.shape[0]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the head dimension of q and k must be contiguous")
    if T == 0:
        return
    _rotary_kernel[(T,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q.shape[1],
        k.shape[1],
        rot_dim,
        IS_NEOX=is_neox,
        HALF=triton.next_power_of_2(rot_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
