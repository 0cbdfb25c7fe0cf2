"""Paged attention for a flat batch of query chunks, in one launch.

One program per (query token, KV head) computes attention for the query heads that
share that KV head (GQA/MQA, any group size), walking the sequence's block table with
an online softmax in float32. A decode is a chunk of one token; a prefill chunk may
follow tokens already cached. Causal masking, optional sliding window and logit
soft-cap. The grid depends only on the number of tokens and heads.

This is the first, straightforward version: correct everywhere (tested under the
interpreter against `paged_attention_ref`), not yet tuned (no KV split for small
batches, no tensor-core tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    token_seq_ptr,
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(token_seq_ptr + t)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    q_pos = seq_len - (q_end - t)  # absolute position of this query token

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD], tl.float32)
    s = tl.arange(0, BLOCK_SIZE)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(q_pos - window + 1, 0) // BLOCK_SIZE
    last = q_pos // BLOCK_SIZE + 1
    for b in tl.range(first, last):
        block = tl.load(block_table_ptr + seq * stride_bt + b)
        kpos = b * BLOCK_SIZE + s
        offs = block * stride_kb + s[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + offs).to(tl.float32)
        v = tl.load(v_cache_ptr + offs).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_SIZE]
        if USE_CAP:
            scores = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * scores / soft_cap)) - 1.0)  # cap * tanh
        visible = kpos <= q_pos
        if USE_WINDOW:
            visible = visible & (kpos > q_pos - window)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None],
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_seq: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_table: [S, max_blocks];
    seq_lens: [S] (context + chunk); query_start_loc: [S + 1]; token_seq: [T] sequence of
    each token. Returns [T, Hq, D]. The caches must already hold this step's K/V."""
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = key_cache.shape
    group = Hq // Hkv
    out = torch.empty_like(q)
    if T == 0:
        return out
    _paged_attention_kernel[(T, Hkv)](
        q,
        key_cache,
        value_cache,
        out,
        block_table,
        seq_lens,
        query_start_loc,
        token_seq,
        scale,
        soft_cap or 1.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        BLOCK_G=max(triton.next_power_of_2(group), 1),
        HEAD=D,
        BLOCK_SIZE=block_size,
        USE_CAP=soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
    )
    return out


def paged_attention_ref(
    q,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_start_loc,
    scale,
    sliding_window=None,
    soft_cap=None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, float32."""
    out = torch.empty_like(q)
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // Hkv
    for i in range(len(seq_lens)):
        start, end, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if end == start:
            continue
        blocks = block_table[i, : -(-n // block_size)].long()
        k = key_cache[blocks].reshape(-1, Hkv, q.shape[2])[:n].float().repeat_interleave(group, 1)
        v = value_cache[blocks].reshape(-1, Hkv, q.shape[2])[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(n - (end - start), n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window:
            mask &= kpos > qpos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
