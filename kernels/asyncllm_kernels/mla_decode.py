"""Multi-head latent attention (MLA) decode over the paged latent cache.

DeepSeek-V2/V3 cache one vector per token: the compressed KV latent (L values,
`kv_lora_rank`) followed by the rotary key part (R values, `qk_rope_head_dim`), shared
by every head. A decode query is first projected into the latent space (the "absorbed"
key up-projection), so each head's query is L + R values, and attention reads the cache
entries as keys (all L + R) and their first L values as values:

    out[s, h] = softmax(scale * q[s, h] . cache[k]) over the keys k of sequence s, then
                sum over k of weight * cache[k, :L]

This is multi-query attention with one KV head of L + R dims, so one program takes a
block of heads and reads each cache block once for all of them. The keys of a sequence
are split into `num_splits` ranges handled by separate programs (a batch of one long
sequence still fills the GPU), each storing its partial output and log-sum-exp; a
second launch weighs them into the output. The grid depends only on shapes, so a decode batch can be captured
in a CUDA graph. `reference.mla_decode_ref` is the plain-torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _concat_and_cache_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_ptr,
    stride_c,
    stride_pe,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding: nothing to write
        return
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(kv_c_ptr + token * stride_c + offs_l, mask=offs_l < L)
    pe = tl.load(k_pe_ptr + token * stride_pe + offs_r, mask=offs_r < R)
    tl.store(cache_ptr + slot * (L + R) + offs_l, c, mask=offs_l < L)
    tl.store(cache_ptr + slot * (L + R) + L + offs_r, pe, mask=offs_r < R)


def concat_and_cache_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes each token's latent [T, L] and rotary key [T, R] into its cache slot
    (kv_cache [blocks, block_size, L + R]); a negative slot is skipped."""
    T, L = kv_c.shape
    R = k_pe.shape[1]
    if T == 0:
        return
    _concat_and_cache_kernel[(T,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        L,
        R,
        triton.next_power_of_2(L),
        triton.next_power_of_2(R),
    )


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [S, H, L + R]
    cache_ptr,  # [blocks * block_size, L + R]
    block_table_ptr,  # [S, max_blocks]
    seq_lens_ptr,  # [S]
    out_ptr,  # [S, H, NUM_SPLITS, L] float32
    lse_ptr,  # [S, H, NUM_SPLITS] float32
    scale,
    stride_qs,
    stride_qh,
    stride_bt,
    num_heads,
    block_size,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + s)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lmask, rmask = offs_l < L, offs_r < R
    q_rows = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_r = tl.load(q_rows + L + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        block = tl.load(block_table_ptr + s * stride_bt + pos // block_size, mask=pmask, other=0)
        rows = (block.to(tl.int64) * block_size + pos % block_size) * (L + R)
        k_c = tl.load(
            cache_ptr + rows[:, None] + offs_l[None, :],
            mask=pmask[:, None] & lmask[None, :],
            other=0.0,
        )
        k_r = tl.load(
            cache_ptr + rows[:, None] + L + offs_r[None, :],
            mask=pmask[:, None] & rmask[None, :],
            other=0.0,
        )
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
        scores += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        scores = tl.where(pmask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=PRECISION)
        m = m_new

    seen = denom > 0
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
    row = (s * num_heads + heads) * NUM_SPLITS + split
    tl.store(
        out_ptr + row[:, None] * L + offs_l[None, :], out, mask=hmask[:, None] & lmask[None, :]
    )
    tl.store(lse_ptr + row, lse, mask=hmask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(num_seqs: int, num_heads: int, device: torch.device) -> int:
    """Key ranges per sequence: enough programs for two waves over the SMs."""
    if device.type != "cuda":
        return 2  # (the interpreter: still exercises the merge)
    programs = max(num_seqs, 1) * triton.cdiv(num_heads, _block_h(num_heads))
    return max(1, min(32, 2 * _num_sms(device.index or 0) // programs))


def _block_h(num_heads: int) -> int:
    return max(16, min(32, triton.next_power_of_2(num_heads)))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """out [S, H, L] (q's dtype) for q [S, H, L + R], the latent cache [blocks,
    block_size, L + R], block_table [S, max_blocks] and seq_lens [S] (0: zeros)."""
    S, H, D = q.shape
    L = kv_lora_rank
    R = D - L
    block_size = kv_cache.shape[1]
    splits = num_splits(S, H, q.device)
    part = torch.empty(S, H, splits, L, dtype=torch.float32, device=q.device)
    lse = torch.empty(S, H, splits, dtype=torch.float32, device=q.device)
    if S == 0:
        return q.new_empty(0, H, L)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_h = _block_h(H)
    grid = (S, triton.cdiv(H, block_h), splits)
    _mla_decode_kernel[grid](
        q,
        kv_cache,
        block_table,
        seq_lens,
        part,
        lse,
        scale,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        H,
        block_size,
        L,
        R,
        max(16, triton.next_power_of_2(L)),  # (tl.dot wants 16 or more)
        max(16, triton.next_power_of_2(R)),
        block_h,
        32 if L > 256 else 64,
        splits,
        "ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    out = torch.empty(S, H, L, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(S * H,)](
        part,
        lse,
        out,
        L,
        triton.next_power_of_2(L),
        splits,
        triton.next_power_of_2(splits),
    )
    return out


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [S * H, NUM_SPLITS, L] float32
    lse_ptr,  # [S * H, NUM_SPLITS] float32
    out_ptr,  # [S * H, L]
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(
        lse_ptr + row * NUM_SPLITS + splits, mask=splits < NUM_SPLITS, other=float("-inf")
    )
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    total = tl.sum(w, axis=0)
    w = w / tl.where(total > 0, total, 1.0)
    offs = tl.arange(0, BLOCK_L)
    part = tl.load(
        part_ptr + (row * NUM_SPLITS + splits)[:, None] * L + offs[None, :],
        mask=(splits < NUM_SPLITS)[:, None] & (offs < L)[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + row * L + offs, out.to(out_ptr.dtype.element_ty), mask=offs < L)
