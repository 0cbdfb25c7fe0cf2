"""Rotary embedding applied to q and k in place, NeoX (halves) or GPT-J (pairs) layout.

The cos/sin table is [max_position, rotary_dim] float32: cos in the first half of each
row, sin in the second. Dimensions past rotary_dim are left alone (partial rotary).
The plain-torch reference is `apply_rotary_ref` in reference.py. The same launch can
first RMS-normalise each head (Qwen3's per-head q/k norms): reference `rms_norm_ref`
on each head, then `apply_rotary_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base, stride_h, num_heads, cos, sin, offs, mask, rot_dim, IS_NEOX, BLOCK_H,
    w_ptr, eps, NORM: tl.constexpr,
):  # fmt: skip
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
    if NORM:
        # Each head's RMSNorm first (the rotation covers the whole head: both halves are
        # the head), rounded as the unfused norm rounds: normalised, cast, then scaled.
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / rot_dim
        r = tl.math.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + i1, mask=mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + i2, mask=mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(out_ty).to(tl.float32) * w1).to(out_ty).to(tl.float32)
        x2 = ((x2 * r).to(out_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    tl.store(ptr + i1[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=m)
    tl.store(ptr + i2[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=m)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads: tl.constexpr,
    num_k_heads: tl.constexpr,
    rot_dim: tl.constexpr,
    IS_NEOX: tl.constexpr,
    NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    """One program per token: its cos/sin row is read once for all q and k heads; with
    NORM, each head is RMS-normalised (q and k by their own weights) before rotating."""
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, HALF)
    mask = offs < rot_dim // 2
    cos = tl.load(cache_ptr + pos * rot_dim + offs, mask=mask, other=1.0)
    sin = tl.load(cache_ptr + pos * rot_dim + rot_dim // 2 + offs, mask=mask, other=0.0)
    t = token.to(tl.int64)
    _rotate_heads(
        q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs, mask, rot_dim,
        IS_NEOX, BLOCK_HQ, q_w_ptr, eps, NORM,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, offs, mask, rot_dim,
        IS_NEOX, BLOCK_HK, k_w_ptr, eps, NORM,
    )  # fmt: skip


def apply_rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (last dim contiguous), rotated in place, one launch.
    With `norm_weights` (q's, k's: [D] each), each head is first RMS-normalised over its
    D values (Qwen3's q_norm and k_norm); that needs the rotation to cover whole heads."""
    rot_dim = cos_sin_cache.shape[-1]
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"q has {T} tokens, k has {k.shape[0]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the head dimension of q and k must be contiguous")
    if norm_weights is not None and not (q.shape[-1] == k.shape[-1] == rot_dim):
        raise ValueError(
            f"a norm fused with the rotation needs it over whole heads: rotary_dim {rot_dim}, "
            f"head sizes {q.shape[-1]} and {k.shape[-1]}"
        )
    if T == 0:
        return
    q_w, k_w = norm_weights if norm_weights is not None else (cos_sin_cache, cos_sin_cache)
    _rotary_kernel[(T,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q_w,
        k_w,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q.shape[1],
        k.shape[1],
        rot_dim,
        IS_NEOX=is_neox,
        NORM=norm_weights is not None,
        HALF=triton.next_power_of_2(rot_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
