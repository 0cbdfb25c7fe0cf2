"""y = x @ w.T for the few rows of a small decode batch (x: [M <= 16, K], w: [N, K]).

At batch 1-16 a linear layer is a stream of its weight: the time is the weight's bytes
over the memory bandwidth, if enough of the GPU's SMs are loading at once. cuBLAS's
choices for some of these shapes reach far less on an H200 (Llama-3.1-8B's o_proj at
M=1: 0.58 of it; Qwen3-0.6B's: 0.08), and some need a second, split-K reduction kernel. Here one
program owns BLOCK_N rows of w and streams them along K: the rows of x are padded to 16
in registers, so one `tl.dot` per tile covers every M up to 16, with no reduction pass.
The accumulation is float32; the output takes x's dtype.

`skinny_config(M, N, K)` says whether (and how) to use it: the configs come from
benchmarks/kernels/sweep_skinny_gemm.py on an H200, for the shapes where they beat
cuBLAS; `None` means use cuBLAS.
"""

from __future__ import annotations

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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig) -> torch.Tensor:
    """x: [M, K] with M <= 16, w: [N, K] (each with a unit stride along K) -> [M, N]."""
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"x has {K} columns and w {Kw}: they must match")
    if M > MAX_M:
        raise ValueError(f"skinny_gemm takes at most {MAX_M} rows, got {M}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a unit stride along K")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
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
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.options(x),
    )
    return out


# (N, K) -> ((largest M, config), ...) in increasing M: where a config beat cuBLAS on an
# H200 (bf16, benchmarks/kernels/sweep_skinny_gemm.py, docs/benchmarks.md). M=1 compiles
# its own kernel (Triton specializes an argument equal to 1), hence its own entries.
# Shapes and M not listed here use cuBLAS.
_M1 = SkinnyConfig(block_n=32, block_k=512, num_warps=4, num_stages=3)
TUNED: dict[tuple[int, int], tuple[tuple[int, SkinnyConfig], ...]] = {
    # Llama-3.1-8B o_proj: 11.8 / 12.2 us against cuBLAS's 13.5 (M = 1 / 2-16)
    (4096, 4096): ((1, _M1), (16, SkinnyConfig(32, 128, 4, 6))),
    # Llama-3.1-8B down_proj at M = 1: 31.2 us against 32.3
    (4096, 14336): ((1, _M1),),
    # Qwen3-0.6B o_proj: 5.2 / 5.9 us against 12.7 (M = 1) and 8.0-12.8 (M = 2-4)
    (1024, 2048): ((1, _M1), (7, SkinnyConfig(16, 256, 4, 6))),
    # Qwen3-0.6B down_proj and qkv at M = 1: 6.6 against 7.4, 5.0 against 5.3
    (1024, 3072): ((1, _M1),),
    (4096, 1024): ((1, _M1),),
}


def skinny_config(m: int, n: int, k: int, dtype: torch.dtype) -> SkinnyConfig | None:
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    for largest, config in TUNED.get((n, k), ()):
        if m <= largest:
            return config
    return None
