"""A mixture-of-experts layer as two grouped GEMMs over tokens sorted by expert.

Each of T tokens is routed to K experts. The T * K (token, expert) pairs ("slots": slot
s is token s // K's k-th choice) are sorted by expert and each expert's run is padded to
a multiple of BLOCK_M (`align_slots_by_expert`), so a tile of BLOCK_M sorted slots
belongs to one expert: one program multiplies those slots' rows by that expert's weight
tile, and a decode step reads each routed expert's weights once, however many of the
batch's tokens chose it.

    h = x[s // K] @ w13[e].T          (w13: [E, 2I, H], gate then up)
    a = silu(h[:, :I]) * h[:, I:]
    y[s] = weight[s] * (a @ w2[e].T)  (w2: [E, H, I])
    out[t] = sum over k of y[t * K + k]

The first GEMM's programs take a gate tile and the up tile of the same columns, so `a` is
written by its epilogue (h is never stored), and only the blocks that can hold a slot are
launched: a layer is four launches (sort, two GEMMs, the sum).

Up to `SMALL_BATCH_TOKENS` tokens (decode at batch 1-4, where these launches are most of
a layer's time and few experts are shared) there is no sort: each slot's programs read
their expert's id and stream its weight rows (the skinny GEMM's form: one row padded to
16 for `tl.dot`), the routing weight is applied in the gate/up epilogue (a[s] =
weight[s] * silu(gate) * up, the same sum by linearity), and each down program walks
its token's K experts in one loop into one accumulator, so the sum over experts needs no
launch or store of its own: two launches. (A config of fewer than 16 rows takes the
one-row form: float32 products without `tl.dot`, for more programs on a narrow model;
the down GEMM's loads every expert's tile of a K chunk at once, [K, rows, chunk].) Given the router's
logits (`fused_moe_routed`) the gate/up programs also route their token themselves
(`_top_experts`, the routing kernel's own steps, or a rank of every expert in one pass),
and the routing launch goes too.

The sort runs on the device with fixed-size outputs (no host sync), so a step can be
captured in a CUDA graph. `reference.fused_moe_ref` is the same in plain torch, expert
by expert: the CPU path, and the kernel's reference in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Up to this many slots (decode batches up to about 170 tokens at 6 experts each) the
# sort is one program's launch; past it the program's tile loop costs more than the torch
# ops' launches (79 µs for 1,536 slots on an H100, 64-slot tiles).
SMALL_ALIGN_SLOTS = 1024


def align_slots_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_slots, block_experts, num_padded): the slots (indices into
    topk_ids.flatten()) grouped by expert in slot order, each expert's group padded
    with T * K (no slot) to a multiple of `block_m`; the expert of each block of
    `block_m`; and the padded length as a one-element tensor. Outputs have their largest
    size, T * K + E * (block_m - 1) rounded up to `block_m`, whatever the routing.

    Up to `SMALL_ALIGN_SLOTS` slots (decode steps) one Triton program does it all in one
    launch; more take the torch ops (`align_slots_by_expert_torch`), a dozen launches
    that scale."""
    n = topk_ids.numel()
    if n > SMALL_ALIGN_SLOTS:
        return align_slots_by_expert_torch(topk_ids, num_experts, block_m)
    flat = topk_ids.flatten()
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_slots = torch.empty(size, dtype=torch.int64, device=flat.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int64, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int64, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    # (slot tiles of at most 16k one-hot entries: few loop turns, no register spills)
    block = max(16, min(256, triton.next_power_of_2(n), 16384 // block_e))
    _align_small_kernel[(1,)](
        flat,
        sorted_slots,
        block_experts,
        num_padded,
        n,
        size,
        num_experts,
        block_m,
        BLOCK=block,
        BLOCK_E=block_e,
        num_warps=8,
    )
    return sorted_slots, block_experts, num_padded


@triton.jit
def _align_small_kernel(
    ids_ptr,
    sorted_ptr,
    block_experts_ptr,
    num_padded_ptr,
    n,
    size,
    num_experts,
    block_m,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0).to(tl.int64))
    for start in range(0, size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + offs, tl.zeros([BLOCK], dtype=tl.int64) + n, mask=offs < size)
    real = experts < num_experts
    for start in range(0, size // block_m, BLOCK):
        blocks = start + tl.arange(0, BLOCK)
        first = blocks * block_m
        e = tl.sum(((ends[None, :] <= first[:, None]) & real[None, :]).to(tl.int64), axis=1)
        tl.store(
            block_experts_ptr + blocks,
            tl.minimum(e, num_experts - 1),
            mask=blocks < size // block_m,
        )
    tl.debug_barrier()  # (the padding is written before the slots overwrite it)
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0)  # inclusive: 1 for an expert's first slot here
        pos = tl.sum(onehot * ((starts + seen)[None, :] + rank - 1), axis=1)
        tl.store(sorted_ptr + pos, offs.to(tl.int64), mask=offs < n)
        seen += tl.sum(onehot, axis=0)


def align_slots_by_expert_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_slots_by_expert` in torch ops (any number of slots)."""
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    # each sorted slot's rank within its expert's group
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - first_of_expert[flat[order]]
    sorted_slots = torch.full((size,), n, dtype=torch.int64, device=dev)
    sorted_slots.scatter_(0, starts[flat[order]] + rank, order)
    blocks = torch.arange(size // block_m, device=dev) * block_m
    block_experts = torch.searchsorted(ends, blocks, right=True).clamp_(max=num_experts - 1)
    return sorted_slots, block_experts, ends[-1:]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (rows = tokens, A_ROW_DIV = top_k) or a (rows = slots, 1)
    w_ptr,  # [E, N, K]
    c_ptr,  # [slots, N]
    weights_ptr,  # [slots] routing weights (used with MUL_WEIGHT)
    sorted_slots_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + offs_m)
    valid = slots < num_slots
    rows = tl.where(valid, slots // A_ROW_DIV, 0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # (GATED: the up columns)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(
                w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )
            up += tl.dot(a, w_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:  # silu(gate) * up, in float32
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if MUL_WEIGHT:
        rw = tl.load(weights_ptr + slots, mask=valid, other=0.0)
        acc = acc * rw.to(tl.float32)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GroupedConfig:
    """A grouped GEMM's tiles along N and K, and its launch options."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def _tile_options(cfg: GroupedConfig, dtype: torch.dtype) -> dict:
    """A GEMM kernel's launch keywords for its tiles, and its products' precision:
    float32 in full precision, not TF32 (the reference's)."""
    return dict(
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def grouped_config(n: int, k: int) -> GroupedConfig:
    """The tiles for N output columns and K inputs: 64 along N and 128 along K, or the
    dimension's power of two at least 16 where it is smaller. (On an H100, for both
    models' layers at 1-256 tokens, within 2% of the best of 48 configs and 2-15% faster
    than 64 x 64: `benchmarks/kernels/sweep_moe.py`, docs/benchmarks.md.)"""
    return GroupedConfig(
        block_n=64 if n >= 64 else triton.next_power_of_2(max(n, 16)),
        block_k=128 if k >= 128 else triton.next_power_of_2(max(k, 16)),
    )


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor | None,
    a_row_div: int,
    block_m: int,
    gated: bool = False,
    config: GroupedConfig | None = None,
) -> None:
    """out[s] = a[s // a_row_div] @ w[expert of s].T for each sorted slot s (`routing`
    from `align_slots_by_expert` with `block_m`), times the slot's routing weight when
    `topk_weights` is given; `gated`: w's rows are gate then up (2N of them) and out
    takes silu(gate) * up, N columns. `config`: the tiles (`grouped_config` by
    default)."""
    sorted_slots, block_experts, num_padded = routing
    num_slots = out.shape[0]
    N, K = w.shape[1] // 2 if gated else w.shape[1], w.shape[2]
    cfg = config or grouped_config(N, K)
    # (every block that holds a slot holds at least one: no more than num_slots of them)
    grid = (min(sorted_slots.numel() // block_m, num_slots), triton.cdiv(N, cfg.block_n))
    weights = topk_weights if topk_weights is not None else out
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        weights,
        sorted_slots,
        block_experts,
        num_padded,
        num_slots,
        N,
        K,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=block_m,
        **_tile_options(cfg, a.dtype),
    )


# Up to this many tokens a layer takes the small-batch path (no sort, two launches).
SMALL_BATCH_TOKENS = 4


@triton.jit
def _small_gate_up_gemm_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [E, 2N, K]: gate rows then up rows
    a_ptr,  # [T * TOP_K, N]
    ids_ptr,  # [T * TOP_K]: read, or with ROUTE written
    weights_ptr,  # [T * TOP_K] (unused with ROUTE)
    logits_ptr,  # [T, num_experts] with ROUTE (the router's output), else unused
    N,
    K,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    stride_l,
    scaling,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BY_RANK: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if ROUTE:
        # Every program of the slot's token routes it (a few microseconds' launch less
        # than a routing kernel); the first column tile's programs keep the ids for down.
        ids, weights = _top_experts(
            logits_ptr + (s // TOP_K) * stride_l,
            num_experts,
            scaling,
            TOP_K,
            RENORMALIZE,
            ROUND,
            BLOCK_E,
            BY_RANK,
        )
        choice = tl.arange(0, triton.next_power_of_2(TOP_K)) == s % TOP_K
        expert = tl.sum(tl.where(choice, ids, 0)).to(tl.int64)
        weight = tl.sum(tl.where(choice, weights, 0.0))
        if pid_n == 0:
            tl.store(ids_ptr + s, expert)
    else:
        expert = tl.load(ids_ptr + s).to(tl.int64)
        weight = tl.load(weights_ptr + s).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    if BLOCK_N >= 16:
        offs_m = tl.arange(0, 16)  # (row 0 is the slot's token; 1-15 pad the dot)
        first = offs_m[:, None] == 0
        x_ptrs = x_ptr + (s // TOP_K) * stride_xm + offs_m[:, None] * 0 + offs_k[None, :]
        w_ptrs = (
            w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        )
        up_ptrs = w_ptrs + N * stride_wn
        gate = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=first & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            u = tl.load(up_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            gate = tl.dot(x, tl.trans(w), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.trans(u), up, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        g = tl.sum(gate, axis=0)  # (the padding rows are zeros)
        u_sum = tl.sum(up, axis=0)
    else:
        # Fewer rows a program: float32 products of the token's row with each tile,
        # summed along K at the end (no tl.dot; more programs on a narrow expert).
        x_row = x_ptr + (s // TOP_K) * stride_xm + offs_k
        w_rows = (
            w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        )
        gate_sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up_sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            tile_mask = n_mask[:, None] & k_mask[None, :]
            x1 = tl.load(x_row + k0, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            gate_sums += tl.load(w_rows + k0, mask=tile_mask, other=0.0).to(tl.float32) * x1
            up_rows = w_rows + N * stride_wn + k0
            up_sums += tl.load(up_rows, mask=tile_mask, other=0.0).to(tl.float32) * x1
        g = tl.sum(gate_sums, axis=1)
        u_sum = tl.sum(up_sums, axis=1)
    a = g / (1.0 + tl.exp(-g)) * u_sum * weight
    tl.store(a_ptr + s * stride_am + offs_n, a.to(a_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _small_down_gemm_kernel(
    a_ptr,  # [T * TOP_K, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [T, N]
    ids_ptr,  # [T * TOP_K]
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    first = offs_m[:, None] == 0
    n_mask = offs_n < N
    w_rows = offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    chunks = tl.cdiv(K, BLOCK_K)
    if BLOCK_N >= 16:
        # The token's row padded to 16 for `tl.dot`; one loop over the token's experts and
        # their K tiles, so that it pipelines whole.
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for i in range(0, TOP_K * chunks):
            s = t * TOP_K + i // chunks
            k0 = (i % chunks) * BLOCK_K
            k_mask = (k0 + offs_k) < K
            expert = tl.load(ids_ptr + s).to(tl.int64)
            a = tl.load(
                a_ptr + s * stride_am + k0 + offs_m[:, None] * 0 + offs_k[None, :],
                mask=first & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + expert * stride_we + k0 + w_rows,
                mask=n_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        out = tl.sum(acc, axis=0)
    else:
        # Fewer rows a program (more programs on a narrow model): every expert's tile of
        # a K chunk in one load ([experts, BLOCK_N, BLOCK_K], the ids read once), float32
        # products summed over the experts and, at the end, along K.
        KP: tl.constexpr = triton.next_power_of_2(TOP_K)
        slot = tl.arange(0, KP)
        slot_mask = slot < TOP_K
        experts = tl.load(ids_ptr + t * TOP_K + slot, mask=slot_mask, other=0).to(tl.int64)
        w_base = w_ptr + experts[:, None, None] * stride_we + w_rows[None, :, :]
        a_base = a_ptr + (t * TOP_K + slot)[:, None] * stride_am + offs_k[None, :]
        row_mask = slot_mask[:, None, None] & n_mask[None, :, None]
        sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_base + k0, mask=row_mask & k_mask[None, None, :], other=0.0)
            a = tl.load(a_base + k0, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
            sums += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=0)
        out = tl.sum(sums, axis=1)
    tl.store(out_ptr + t * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


# (tokens, hidden size, expert intermediate size) -> (gate/up, down): tiles measured on
# this process's card, ahead of `small_configs`' own choice (asyncllm_kernels.tiles)
SMALL_TUNED: dict[tuple[int, int, int], tuple[GroupedConfig, GroupedConfig]] = {}


def small_configs(
    num_tokens: int, hidden: int | None = None, inter: int | None = None
) -> tuple[GroupedConfig, GroupedConfig]:
    """The small-batch GEMMs' tiles (gate/up, down) at `num_tokens` tokens: those of
    `SMALL_TUNED` for the layer's shape where it has them, else these, measured on an
    H100 (`benchmarks/kernels/sweep_moe.py --small`, Qwen3-30B-A3B and DeepSeek-V2-Lite
    at 1, 2 and 4 tokens): gate/up 32 x 128, 4 stages, within 2% of the best everywhere;
    down, whose programs walk their token's experts one after another, 16 x 512 at one
    token (128 programs on a 2,048-wide model), 5 stages; above it 32 x 256, 8 stages at
    two tokens (1.7-2.5 us faster than 5) and 5 at three or four."""
    tuned = SMALL_TUNED.get((num_tokens, hidden or 0, inter or 0))
    if tuned is not None:
        return tuned
    if num_tokens == 1:
        down = GroupedConfig(16, 512, 4, 5)
    else:
        down = GroupedConfig(32, 256, 4, 8 if num_tokens == 2 else 5)
    return GroupedConfig(32, 128, 4, 4), down


def fused_moe_small(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[GroupedConfig, GroupedConfig] | None = None,
) -> torch.Tensor:
    """`fused_moe` without the sort, in two launches (the module docstring): for a few
    tokens. `configs`: the gate/up and down GEMMs' tiles (`small_configs` by default)."""
    x = x.contiguous()
    ids = topk_ids.flatten().contiguous()
    gate_up, down = configs or small_configs(x.shape[0], x.shape[1], w2.shape[2])
    a = small_gate_up(x, w13, ids, topk_weights.flatten().contiguous(), gate_up)
    return small_down(a, w2, ids, x.shape[0], down)


@dataclass(frozen=True)
class Route:
    """The router's logits [T, E] and `softmax_topk`'s other arguments, for a gate/up
    launch that routes its tokens itself."""

    logits: torch.Tensor
    renormalize: bool
    scaling: float = 1.0
    round_to: torch.dtype | None = None
    by_rank: bool = True  # (`_top_experts`' ranking in one pass, or its loop over slots)


def fused_moe_routed(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float = 1.0,
    round_to: torch.dtype | None = None,
    by_rank: bool = True,
) -> torch.Tensor:
    """`fused_moe` of the routing `softmax_topk(router_logits, top_k, renormalize,
    scaling, round_to)` gives. Up to `SMALL_BATCH_TOKENS` tokens the gate/up GEMM's
    programs route their tokens themselves: two launches in all."""
    T = x.shape[0]
    if not 1 <= T <= SMALL_BATCH_TOKENS:
        weights, ids = softmax_topk(router_logits, top_k, renormalize, scaling, round_to)
        return fused_moe(x, w13, w2, weights, ids)
    _check_routing(router_logits, top_k, round_to)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    x = x.contiguous()
    ids = torch.empty(T * top_k, dtype=torch.int64, device=x.device)
    gate_up, down = small_configs(T, x.shape[1], w2.shape[2])
    a = small_gate_up(
        x, w13, ids, None, gate_up, Route(logits, renormalize, scaling, round_to, by_rank)
    )
    return small_down(a, w2, ids, T, down)


def small_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    config: GroupedConfig | None = None,
    route: Route | None = None,
) -> torch.Tensor:
    """a [T * K, I]: weights[s] * silu(x[s // K] @ gate[e].T) * (x[s // K] @ up[e].T) for
    each slot s and its expert e = ids[s] (ids and weights: [T * K], contiguous). With
    `route`, the ids and weights are the routing's (`softmax_topk`'s [T, K], flattened),
    and the ids are written into `ids`; `weights` is not read."""
    (T, H), slots, inter = x.shape, ids.numel(), w13.shape[1] // 2
    cfg = config or small_configs(T, H, inter)[0]
    a = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    logits = route.logits if route is not None else x
    _small_gate_up_gemm_kernel[(slots, triton.cdiv(inter, cfg.block_n))](
        x,
        w13,
        a,
        ids,
        weights if weights is not None else ids,
        logits,
        inter,
        H,
        logits.shape[1],
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        a.stride(0),
        logits.stride(0),
        float(route.scaling) if route is not None else 1.0,
        TOP_K=slots // T,
        ROUTE=route is not None,
        RENORMALIZE=route is not None and route.renormalize,
        ROUND=_ROUND[route.round_to] if route is not None else None,
        BLOCK_E=triton.next_power_of_2(logits.shape[1]),
        BY_RANK=route is not None and route.by_rank,
        **_tile_options(cfg, x.dtype),
    )
    return a


def small_down(
    a: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    num_tokens: int,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """out [T, H]: the sum over each token's K slots s of a[s] @ w2[ids[s]].T."""
    slots, inter = a.shape
    H = w2.shape[1]
    cfg = config or small_configs(num_tokens, H, inter)[1]
    out = torch.empty(num_tokens, H, dtype=a.dtype, device=a.device)
    _small_down_gemm_kernel[(num_tokens, triton.cdiv(H, cfg.block_n))](
        a,
        w2,
        out,
        ids,
        H,
        inter,
        a.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        TOP_K=slots // num_tokens,
        **_tile_options(cfg, a.dtype),
    )
    return out


def block_m_for(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Slots per tile: small for a few slots per expert (decode), larger for prefill."""
    per_expert = num_tokens * top_k / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """out [T, H] for x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights/ids [T, K]
    (see the module docstring); x's dtype, float32 accumulation. (Routing weights in
    float32, as `softmax_topk` gives them, take no conversion launch.)"""
    T = x.shape[0]
    if T == 0:
        return torch.zeros_like(x)
    if T <= SMALL_BATCH_TOKENS:
        return fused_moe_small(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_sorted(x, w13, w2, topk_weights, topk_ids)


def fused_moe_sorted(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe` through the sort by expert, for any number of tokens."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, two_i, _ = w13.shape
    x = x.contiguous()
    block_m = block_m_for(T, K, E)
    routing = align_slots_by_expert(topk_ids, E, block_m)
    a = torch.empty(T * K, two_i // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, a, routing, None, K, block_m, gated=True)
    y = torch.empty(T * K, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.flatten().to(torch.float32).contiguous()
    grouped_gemm(a, w2, y, routing, weights, 1, block_m)
    return y.view(T, K, H).sum(dim=1)  # (accumulated in float32 for half types)


@triton.jit
def _top_experts(
    logits_ptr,  # one token's [num_experts] logits
    num_experts,
    scaling,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,  # (None, or the dtype the weights are rounded through)
    BLOCK_E: tl.constexpr,
    BY_RANK: tl.constexpr = False,
):
    """(ids, weights), each [next_power_of_2(K)] (entries past K are 0): `softmax_topk`
    for one token."""
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    # A NaN (from a NaN or infinite logit) ranks as probability 0, so that every row gets
    # K distinct experts in range whatever its logits; padding ranks below any expert,
    # and a chosen expert below that.
    p = tl.where(p == p, p, 0.0)
    p = tl.where(mask, p, -1.0)
    slots = tl.arange(0, triton.next_power_of_2(K))
    if BY_RANK:
        # Each expert's rank in one pass: how many experts come before it (a higher
        # probability, or an equal one and a lower id); slot k takes the expert of rank k.
        # Three reductions where the loop below takes two for each of the K slots.
        p_j, p_i = tl.expand_dims(p, 0), tl.expand_dims(p, 1)
        j_before_i = tl.expand_dims(offs, 0) < tl.expand_dims(offs, 1)
        rank = tl.sum(((p_j > p_i) | ((p_j == p_i) & j_before_i)).to(tl.int32), axis=1)
        slot = tl.expand_dims(slots, 0)
        pick = (tl.expand_dims(rank, 1) == slot) & (slot < K)  # [BLOCK_E, K]
        ids = tl.sum(tl.where(pick, tl.expand_dims(offs, 1), 0), axis=0)
        weights = tl.sum(tl.where(pick, tl.expand_dims(p, 1), 0.0), axis=0)
        total = tl.sum(weights, axis=0)
    else:
        ids = tl.zeros([triton.next_power_of_2(K)], dtype=tl.int32)
        weights = tl.zeros([triton.next_power_of_2(K)], dtype=tl.float32)
        total = 0.0
        for k in tl.static_range(K):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # (the lowest on a tie)
            ids = tl.where(slots == k, idx, ids)
            weights = tl.where(slots == k, best, weights)
            total += best
            p = tl.where(offs == idx, -2.0, p)
    if RENORMALIZE:
        weights = weights / total
    weights = weights * scaling
    if ROUND is not None:
        weights = weights.to(ROUND).to(tl.float32)
    return ids, weights


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int64
    num_experts,
    stride_l,
    scaling,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ids, weights = _top_experts(
        logits_ptr + t * stride_l, num_experts, scaling, K, RENORMALIZE, ROUND, BLOCK_E
    )
    slots = tl.arange(0, triton.next_power_of_2(K))
    tl.store(ids_ptr + t * K + slots, ids.to(tl.int64), mask=slots < K)
    tl.store(weights_ptr + t * K + slots, weights, mask=slots < K)


_ROUND = {None: None, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _check_routing(router_logits: torch.Tensor, top_k: int, round_to: torch.dtype | None) -> None:
    if round_to not in _ROUND:
        raise ValueError(f"round_to must be bfloat16, float16 or None, got {round_to}")
    E = router_logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be between 1 and the {E} experts, got {top_k}")


def softmax_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float = 1.0,
    round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64), best first: the k highest
    softmax probabilities of each row (computed in float32), renormalised to sum to 1 when
    asked, times `scaling`, and rounded through `round_to` (bfloat16 or float16) when
    given; one launch (torch's softmax, topk, scaling and casts take three or more). A
    row with a NaN or an infinite logit still gets k distinct experts in range (its
    NaN probabilities rank as 0)."""
    _check_routing(router_logits, top_k, round_to)
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    _softmax_topk_kernel[(T,)](
        logits,
        weights,
        ids,
        E,
        logits.stride(0),
        float(scaling),
        K=top_k,
        RENORMALIZE=renormalize,
        ROUND=_ROUND[round_to],
        BLOCK_E=triton.next_power_of_2(E),
    )
    return weights, ids
