"""Plain-torch references for the Triton kernels: the tests compare each kernel with its
reference, and asyncllm's layers run these on devices without the kernels (the CPU).

Kept apart from the kernel modules so that using them imports torch only: importing a
kernel module imports Triton and fixes the mode of its `triton.jit` kernels (compiled,
or interpreted under TRITON_INTERPRET=1) at that moment.

Precision follows the kernels: the arithmetic is done in float32 and the result is
rounded once to the input's dtype (for float32 inputs that is the plain computation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, H, D]; caches: [num_blocks, block_size, H, D]. Token t goes to slot
    `slot_mapping[t]` (block * block_size + offset); a negative slot is not written."""
    rows = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping.index_select(0, rows).long()
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, *src.shape[1:])
        flat.index_copy_(0, slots, src.index_select(0, rows).to(cache.dtype))


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) or, with a residual, norm(x + residual) with the residual updated in place
    to x + residual (rounded to its dtype, as the models do). The normalised value is
    cast back to x's dtype before the scaling, as the reference models do."""
    dtype = x.dtype
    if residual is not None:
        x = residual.add_(x)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x: [..., 2d]."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def apply_rotary_ref(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool = True
) -> torch.Tensor:
    """x: [T, H, D] rotated by the rows of `cos_sin_cache` ([max_position, rotary_dim]:
    cos then sin) at `positions`; NeoX (halves) or GPT-J (pairs) layout. Dimensions past
    rotary_dim are left alone. Returns a new tensor."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    out = out.to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, float32. Arguments as `paged_attention`'s."""
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


def apply_token_bitmask_ref(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> None:
    """Masks, in place, the tokens row `rows[i]` of `logits` may not take: `bitmask[i]`
    packs one bit per token (int32 words, token t is bit t % 32 of word t // 32; set:
    allowed). Tokens past the bitmask's width are masked."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """A mixture-of-experts layer (fused_moe.py's docstring), one routed expert at a
    time: out [T, H] for x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K];
    the routed outputs summed in float32."""
    T, H = x.shape
    K = topk_ids.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    i = w13.shape[1] // 2
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        slots = order[start : start + c]
        start += c
        rows = slots // K
        h = x[rows] @ w13[e].T
        a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        y = (a @ w2[e].T).float() * topk_weights.flatten()[slots, None].float()
        out.index_add_(0, rows, y)
    return out.to(x.dtype)


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Latent attention of one query token per sequence (mla_decode.py's docstring), in
    float32: out [S, H, L] for q [S, H, L + R] and the latent cache [blocks, block_size,
    L + R]; a sequence of length 0 gets zeros."""
    S, H, _ = q.shape
    block_size = kv_cache.shape[1]
    out = q.new_zeros(S, H, kv_lora_rank)
    for i in range(S):
        n = int(seq_lens[i])
        if n == 0:
            continue
        blocks = block_table[i, : -(-n // block_size)].long()
        keys = kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:n].float()
        scores = (q[i].float() @ keys.T) * scale  # [H, n]
        out[i] = (scores.softmax(-1) @ keys[:, :kv_lora_rank]).to(q.dtype)
    return out
