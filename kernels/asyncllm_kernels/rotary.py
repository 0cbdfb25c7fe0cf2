"""Rotary embedding applied to q and k in place, NeoX (halves) or GPT-J (pairs) layout.

The cos/sin table is [max_position, rotary_dim] float32: cos in the first half of each
row, sin in the second. Dimensions past rotary_dim are left alone (partial rotary).
The plain-torch reference is `apply_rotary_ref` in reference.py. The same launch can
first RMS-normalise each head (Qwen3's per-head q/k norms): reference `rms_norm_ref`
on each head, then `apply_rotary_ref`; and it can write the rotated k and the step's v
into the paged KV cache instead of k (`rotate_into_kv_cache_`; reference: the rotation,
then `reshape_and_cache_ref`), which saves the cache write's launch and its read of k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm_kernels import pdl


@triton.jit
def _rotate_heads(
    base, stride_h, dst, dst_stride_h, num_heads, cos, sin, offs, mask, rot_dim, IS_NEOX,
    BLOCK_H, w_ptr, eps, NORM: tl.constexpr,
):  # fmt: skip
    """Rotates `num_heads` heads read at `base` and stores them at `dst` (the same place,
    or a KV cache row), rounded to the source's dtype first as the unfused path is."""
    h = tl.arange(0, BLOCK_H)
    ptr = base + h[:, None] * stride_h
    out = dst + h[:, None] * dst_stride_h
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
    dst_ty = dst.dtype.element_ty
    if NORM:
        # Each head's RMSNorm first (the rotation covers the whole head: both halves are
        # the head), rounded as the unfused norm rounds: normalised, cast, then scaled.
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / rot_dim
        r = tl.math.rsqrt(ms + eps)[:, None]
        w1 = tl.load(w_ptr + i1, mask=mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + i2, mask=mask, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(out_ty).to(tl.float32) * w1).to(out_ty).to(tl.float32)
        x2 = ((x2 * r).to(out_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty).to(dst_ty)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty).to(dst_ty)
    tl.store(out + i1[None, :], y1, mask=m)
    tl.store(out + i2[None, :], y2, mask=m)


@triton.jit(do_not_specialize=["num_slots"])
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
    v_ptr,
    stride_vt,
    stride_vh,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_slots,
    num_q_heads: tl.constexpr,
    num_k_heads: tl.constexpr,
    rot_dim: tl.constexpr,
    IS_NEOX: tl.constexpr,
    NORM: tl.constexpr,
    CACHE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: its cos/sin row is read once for all q and k heads; with
    NORM, each head is RMS-normalised (q and k by their own weights) before rotating.
    With CACHE, the rotated k and the token's v go to its slot of the paged KV cache
    (none where the slot is negative or the token is past `num_slots`), and k itself
    is left as it was."""
    pdl.begin(PDL)
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    offs = tl.arange(0, HALF)
    mask = offs < rot_dim // 2
    cos = tl.load(cache_ptr + pos * rot_dim + offs, mask=mask, other=1.0)
    sin = tl.load(cache_ptr + pos * rot_dim + rot_dim // 2 + offs, mask=mask, other=0.0)
    t = token.to(tl.int64)
    q_row = q_ptr + t * stride_qt
    _rotate_heads(
        q_row, stride_qh, q_row, stride_qh, num_q_heads, cos, sin, offs, mask, rot_dim,
        IS_NEOX, BLOCK_HQ, q_w_ptr, eps, NORM,
    )  # fmt: skip
    k_row = k_ptr + t * stride_kt
    if CACHE:
        # The cache row is [num_k_heads, head_size] contiguous; head_size == rot_dim.
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1)
        if slot >= 0:
            row = slot * (num_k_heads * rot_dim)
            _rotate_heads(
                k_row, stride_kh, key_cache_ptr + row, rot_dim, num_k_heads, cos, sin, offs,
                mask, rot_dim, IS_NEOX, BLOCK_HK, k_w_ptr, eps, NORM,
            )  # fmt: skip
            h = tl.arange(0, BLOCK_HK)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            m = (h < num_k_heads) & (d < rot_dim)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
            dst = value_cache_ptr + row + h * rot_dim + d
            tl.store(dst, v.to(value_cache_ptr.dtype.element_ty), mask=m)
    else:
        _rotate_heads(
            k_row, stride_kh, k_row, stride_kh, num_k_heads, cos, sin, offs, mask, rot_dim,
            IS_NEOX, BLOCK_HK, k_w_ptr, eps, NORM,
        )  # fmt: skip


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    rot_dim: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
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


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    cache_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    rot_dim = cos_sin_cache.shape[-1]
    T = q.shape[0]
    if T == 0:
        return
    q_w, k_w = norm_weights if norm_weights is not None else (cos_sin_cache, cos_sin_cache)
    v, key_cache, value_cache, slots = cache_write if cache_write is not None else (k, k, k, k)
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
        v,
        v.stride(0),
        v.stride(1),
        key_cache,
        value_cache,
        slots,
        slots.shape[0],
        q.shape[1],
        k.shape[1],
        rot_dim,
        IS_NEOX=is_neox,
        NORM=norm_weights is not None,
        CACHE=cache_write is not None,
        HALF=triton.next_power_of_2(rot_dim // 2),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(rot_dim),
        num_warps=4,
        **pdl.options(q),
    )


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
    _check(q, k, cos_sin_cache.shape[-1], norm_weights)
    _launch(positions, q, k, cos_sin_cache, is_neox, norm_weights, eps, None)


def rotate_into_kv_cache_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
) -> None:
    """`apply_rotary_` for q, and for k and v the paged KV cache write in the same launch
    (as `reshape_and_cache`): token i's rotated k and its v go to slot `slot_mapping[i]`
    of the [num_blocks, block_size, Hk, D] caches; a negative slot, or a token past
    len(slot_mapping), writes nothing (slots past the tokens are not read). k itself is
    not rotated. The rotation must cover whole heads."""
    rot_dim = cos_sin_cache.shape[-1]
    _check(q, k, rot_dim, norm_weights)
    if not (k.shape[-1] == v.shape[-1] == rot_dim):
        raise ValueError(
            f"a KV cache write fused with the rotation needs it over whole heads: rotary_dim "
            f"{rot_dim}, k and v head sizes {k.shape[-1]} and {v.shape[-1]}"
        )
    if v.shape[:2] != k.shape[:2] or v.stride(-1) != 1:
        raise ValueError(f"v must be k's shape {tuple(k.shape)} with its last dim contiguous")
    want = (k.shape[1], rot_dim)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tuple(c.shape[2:]) != want or not c.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous [blocks, block_size, {want[0]}, {rot_dim}]"
            )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    _launch(
        positions, q, k, cos_sin_cache, is_neox, norm_weights, eps,
        (v, key_cache, value_cache, slot_mapping),
    )  # fmt: skip
