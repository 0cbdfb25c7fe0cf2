"""y = x @ w.T for the few rows of a small decode batch (x: [M <= 16, K], w: [N, K]),
optionally with its neighbours in the same launch.

At batch 1-16 a linear layer is a stream of its weight: the time is the weight's bytes
over the memory bandwidth, if enough of the GPU's SMs are loading at once. cuBLAS's
choices for some of these shapes reach far less on an H200 (Llama-3.1-8B's o_proj at
M=1: 0.58 of it; Qwen3-0.6B's: 0.08), and some need a second, split-K reduction kernel. Here one
program owns BLOCK_N rows of w and streams them along K: the rows of x are padded to 16
in registers, so one `tl.dot` per tile covers every M up to 16, with no reduction pass.
The accumulation is float32; the output takes x's dtype. A config of fewer than 16
rows (`block_n` < 16, M = 1 only) takes the one-row form instead: float32 products of
each w tile with x's row, summed along K at the end, without `tl.dot`, so that a narrow
layer is spread over many more programs (Triton does not pipeline these loads: a
program's loads in flight are its tile, hence long K tiles).

At these sizes each launch of a few microseconds is a visible share of a decoder layer,
so the kernel can take in the launches beside it (each a constexpr switch):
- `norm`: RMSNorm of x first, whose weight the caller has folded into w's columns
  (rms_norm(x, g) @ w.T = rsqrt(mean(x²) + eps) * (x @ (w * g).T)), so that x enters
  the dot as loaded. Each program sums the squares of x's rows in a pass of its own
  before the GEMM's loop (x is small, and in L2) and scales its float32 sums by the
  rows' rsqrt at the end. (Summed in the loop instead, from the tiles the dot loads,
  the squares cost 1.5-4x the launch's time on an H200: docs/benchmarks.md.)
- `gated`: w holds the gate rows then the up rows ([2N, K]); the output is
  silu(x @ gate.T) * (x @ up.T), [M, N], computed in float32 (the MLP's gate/up).
- `add_to`: the result is added into that [M, N] tensor in place, in float32 with one
  rounding (a residual stream).

`skinny_config(M, N, K)` says whether (and how) to use it for a plain product: the configs
come from benchmarks/kernels/sweep_skinny_gemm.py on an H200, for the shapes where they
beat cuBLAS; `None` means use cuBLAS. `fused_config` gives the tiles for a product with
its neighbours fused, on any shape (there the kernel replaces cuBLAS and the neighbours'
launches together; untuned, and the first form measured slower: docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncllm_kernels import pdl

MAX_M = 16


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
    PDL: tl.constexpr,
    ROWS: tl.constexpr,  # (16: x's rows padded for tl.dot; 1: one row, BLOCK_N < 16)
    PREFETCH: tl.constexpr,  # (with PDL: the program's first weight bytes into L2 first)
):
    pid = tl.program_id(0)
    if PREFETCH:  # (the weights are no earlier kernel's output: before the wait)
        rows = tl.minimum(BLOCK_N, N - pid * BLOCK_N)
        size = (rows - 1) * stride_wn + K  # (elements, the last row's padding left out)
        nbytes = tl.minimum(
            size * (w_ptr.dtype.element_ty.primitive_bitwidth // 8), pdl.PREFETCH_BYTES
        )
        first = w_ptr + (pid * BLOCK_N).to(tl.int64) * stride_wn
        if GATED:  # (half the bytes each from the gate rows and the up rows)
            pdl.prefetch_l2(first, nbytes // 32 * 16)
            up = w_ptr + (pid * BLOCK_N + N).to(tl.int64) * stride_wn
            pdl.prefetch_l2(up, nbytes // 32 * 16)
        else:
            pdl.prefetch_l2(first, nbytes // 16 * 16)
    pdl.begin(PDL)
    offs_m = tl.arange(0, ROWS)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    # (GATED: the up rows follow the N gate rows)
    up_ptrs = w_ptr + (offs_n + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    squares = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:  # the squares in a pass of their own (x is small, and in L2)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            x32 = x.to(tl.float32)
            squares += tl.sum(x32 * x32, axis=1)
    if ROWS == 16:  # x's rows padded to 16 for tl.dot
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                u = tl.load(up_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                up = tl.dot(x, tl.trans(u), up)
                up_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:  # one row: float32 products, summed along K at the end
        sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up_sums = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            x32 = x.to(tl.float32)  # [1, BLOCK_K]
            sums += w.to(tl.float32) * x32
            if GATED:
                u = tl.load(up_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                up_sums += u.to(tl.float32) * x32
                up_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.sum(sums, axis=1)[None, :]
        up = tl.sum(up_sums, axis=1)[None, :]
    if NORM:
        rstd = tl.rsqrt(squares / K + eps)
        acc = acc * rstd[:, None]
        up = up * rstd[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def skinny_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    config: SkinnyConfig,
    *,
    norm: bool = False,
    eps: float = 1e-6,
    gated: bool = False,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= 16, w: [N, K] (each with a unit stride along K) -> [M, N]:
    x @ w.T; with `norm`, of x's rows scaled by
    rsqrt(mean(x²) + eps) (a norm whose weight is folded into w); with `gated`,
    silu(x @ gate.T) * (x @ up.T), [M, N / 2]; with `add_to`, added into it in place
    (and it is returned)."""
    M, K = x.shape
    rows, Kw = w.shape
    if Kw != K:
        raise ValueError(f"x has {K} columns and w {Kw}: they must match")
    if M > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {M}")
    if config.block_n < 16 and M > 1:
        raise ValueError(
            f"a config of {config.block_n} rows of w a program takes one row of x, got {M}"
        )
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a unit stride along K")
    if gated and rows % 2:
        raise ValueError(f"a gated w holds gate and up rows alike: {rows} rows is odd")
    N = rows // 2 if gated else rows
    if add_to is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    elif tuple(add_to.shape) != (M, N) or add_to.stride(1) != 1:
        raise ValueError(f"add_to must be a [{M}, {N}] tensor with a unit stride along N")
    else:
        out = add_to
    if M == 0:
        return out
    launch = pdl.options(x)
    _skinny_gemm_kernel[(triton.cdiv(N, config.block_n),)](
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        eps,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NORM=norm,
        GATED=gated,
        ADD=add_to is not None,
        ROWS=16 if config.block_n >= 16 else 1,
        PREFETCH=launch["PDL"] and pdl.can_prefetch(w),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch,
    )
    return out


# (N, K) -> ((largest M, config), ...) in increasing M: where a config beat cuBLAS on an
# H200, or where noted an H100 (bf16, benchmarks/kernels/sweep_skinny_gemm.py,
# docs/benchmarks.md). M=1 compiles its own kernel (Triton specializes an argument equal
# to 1), hence its own entries. Shapes and M not listed here use cuBLAS.
_M1 = SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=3)
# (A tiles file, asyncllm_kernels/tiles.py, may also say None for a range: cuBLAS.)
TUNED: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig | None], ...]] = {
    # Llama-3.1-8B o_proj: 11.8 / 12.2 us against cuBLAS's 13.5 (M = 1 / 2-16)
    (4096, 4096): ((1, _M1), (16, SkinnyConfig(32, 128, 4, 6))),
    # Llama-3.1-8B down_proj at M = 1: 31.2 us against 32.3
    (4096, 14336): ((1, _M1),),
    # Qwen3-0.6B o_proj: 5.2 / 5.9 us against 12.7 (M = 1) and 8.0-12.8 (M = 2-4)
    (1024, 2048): ((1, _M1), (7, SkinnyConfig(16, 256, 4, 6))),
    # Qwen3-0.6B down_proj and qkv at M = 1: 6.6 against 7.4, 5.0 against 5.3
    (1024, 3072): ((1, _M1),),
    # Qwen3-30B-A3B o_proj (measured on an H100): 9.5 us against cuBLAS's 10.7 (its split-K
    # GEMM and reduction) at M = 1, 0.93-0.97 of cuBLAS's time at M = 2-16
    (2048, 4096): ((1, _M1), (16, SkinnyConfig(16, 256, 4, 4))),
    (4096, 1024): ((1, _M1),),
}


def skinny_config(m: int, n: int, k: int, dtype: torch.dtype) -> SkinnyConfig | None:
    """The config for a plain [m, k] x [n, k] product, or None where cuBLAS is faster."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    for largest, config in TUNED.get((n, k), ()):
        if m <= largest:
            return config
    return None


@functools.cache
def fused_supported(device: torch.device) -> bool:
    """Whether the layers use the fused kernels on the device: sm_80 and sm_90 on (run on
    sm_90 only). Their largest tiles take 120 KB of shared memory (the gated 32 x 256
    ones at M = 1, 4 stages), past the 99 KB a block of sm_86 and sm_89."""
    major, minor = torch.cuda.get_device_capability(device)
    return major >= 9 or (major, minor) == (8, 0)


@functools.cache
def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    gated: bool = False,
    sms: int = 132,
    norm: bool = False,
) -> SkinnyConfig:
    """The config for a product with a neighbour fused in (w: [n, k], n counting a gated
    w's gate and up rows). At M = 1, as bench_fused_skinny.py measured on an H200 (the
    Llama-3.1-8B and Qwen3-0.6B shapes, docs/benchmarks.md): a norm's product 32 x 512
    tiles (the fastest on both shapes' qkv), a gated one 32 x 256, 4 stages (the fastest
    on the 0.6B's gate/up; on the 8B's, 64 x 128 was, and every fused form lost to
    cuBLAS's GEMM beside the norm and the gate's own launches), a plain one (an add
    after it) the tuned config where the shape has one. Elsewhere 32-row blocks (16-row
    where 32 would leave the last wave of programs mostly empty on a card of `sms` SMs,
    and for a gated w, whose programs load two blocks), with long K tiles at M = 1 and
    shorter ones, deeper pipelined, above; these are unmeasured."""
    if dtype not in (torch.bfloat16, torch.float16) or not 1 <= m <= MAX_M:
        raise ValueError(f"no small-batch kernel for {m} rows of {dtype}")
    if m == 1 and gated:
        return SkinnyConfig(32, 256, 4, 4)
    if m == 1 and norm:
        return SkinnyConfig(32, 512, 4, 3)
    if not gated:
        tuned = skinny_config(m, n, k, dtype)
        if tuned is not None:
            return tuned
    blocks32 = triton.cdiv(n // 2 if gated else n, 32)
    block_n = 16 if gated or (blocks32 > sms and blocks32 % sms < sms // 2) else 32
    if m == 1:
        return SkinnyConfig(block_n, 512, 4, 3)
    return SkinnyConfig(block_n, 128, 4, 6)
