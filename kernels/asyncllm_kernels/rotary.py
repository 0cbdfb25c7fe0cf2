"""Rotary embedding applied to q and k in place, NeoX (halves) or GPT-J (pairs) layout.

The cos/sin table is [max_position, rotary_dim] float32: cos in the first half of each
row, sin in the second. Dimensions past rotary_dim are left alone (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    pos_ptr,
    cache_ptr,
    stride_t,
    stride_h,
    rot_dim: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, HALF)
    mask = offs < rot_dim // 2
    cos = tl.load(cache_ptr + pos * rot_dim + offs, mask=mask, other=1.0)
    sin = tl.load(cache_ptr + pos * rot_dim + rot_dim // 2 + offs, mask=mask, other=0.0)
    base = x_ptr + token * stride_t + head * stride_h
    if IS_NEOX:
        i1 = offs
        i2 = offs + rot_dim // 2
    else:
        i1 = 2 * offs
        i2 = 2 * offs + 1
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def apply_rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (last dim contiguous), rotated in place."""
    rot_dim = cos_sin_cache.shape[-1]
    half = triton.next_power_of_2(rot_dim // 2)
    for x in (q, k):
        if x.shape[0] == 0:
            continue
        assert x.stride(-1) == 1, "the head dimension must be contiguous"
        _rotary_kernel[(x.shape[0], x.shape[1])](
            x,
            positions,
            cos_sin_cache,
            x.stride(0),
            x.stride(1),
            rot_dim,
            IS_NEOX=is_neox,
            HALF=half,
        )


def apply_rotary_ref(positions, x, cos_sin_cache, is_neox=True) -> torch.Tensor:
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)
