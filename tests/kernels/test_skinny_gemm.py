"""The small-batch GEMM against a float32 torch matmul (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.reference import rms_norm_ref, silu_and_mul_ref
from asyncllm_kernels.skinny_gemm import (
    MAX_M,
    SkinnyConfig,
    fused_config,
    skinny_config,
    skinny_gemm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter (numpy) has no bfloat16: that dtype is checked on the GPU only.
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, MAX_M])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 72)])  # the second: N and K not tile multiples
def test_equals_a_float32_matmul(dtype, m, n, k):
    x, w = _rand(m, k, dtype=dtype, seed=m), _rand(n, k, dtype=dtype, seed=n)
    got = skinny_gemm(x, w, SkinnyConfig(block_n=16, block_k=32, num_warps=4, num_stages=2))
    want = x.float() @ w.float().T
    assert got.dtype == dtype and got.shape == (m, n)
    # Float32 accumulation; the one rounding is the output's.
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2), (got.float() - want).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 72)])
def test_fewer_than_16_rows_of_w_a_program_take_one_row_of_x(dtype, block_n, n, k):
    """The one-row form (float32 products summed along K, no tl.dot), for M = 1."""
    x, w = _rand(1, k, dtype=dtype, seed=k), _rand(n, k, dtype=dtype, seed=n)
    got = skinny_gemm(x, w, SkinnyConfig(block_n, 32, 4, 1))
    want = x.float() @ w.float().T
    assert got.dtype == dtype and got.shape == (1, n)
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2), (got.float() - want).abs().max()
    with pytest.raises(ValueError, match="4 rows of w a program takes one row of x, got 2"):
        skinny_gemm(torch.zeros(2, k, dtype=dtype, device=DEVICE), w, SkinnyConfig(4, 32, 4, 1))


def test_a_row_slice_of_a_wider_input_is_read_by_its_stride():
    wide = _rand(4, 96, dtype=torch.float16, seed=0)
    x, w = wide[:, :64], _rand(32, 64, dtype=torch.float16, seed=1)
    got = skinny_gemm(x, w, SkinnyConfig(16, 32, 4, 2))
    assert torch.allclose(got.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)


def test_bad_shapes_are_named():
    w = torch.zeros(16, 32, dtype=torch.float16, device=DEVICE)
    cfg = SkinnyConfig(16, 32, 4, 2)
    with pytest.raises(ValueError, match="columns"):
        skinny_gemm(torch.zeros(1, 48, dtype=torch.float16, device=DEVICE), w, cfg)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_gemm(torch.zeros(17, 32, dtype=torch.float16, device=DEVICE), w, cfg)


def test_only_tuned_16_bit_shapes_get_a_config_and_only_up_to_their_largest_m():
    assert skinny_config(1, 48, 64, torch.float16) is None  # not a tuned shape
    assert skinny_config(1, 4096, 4096, torch.float32) is None
    one, many = (
        skinny_config(1, 1024, 2048, torch.bfloat16),
        skinny_config(7, 1024, 2048, torch.bfloat16),
    )
    assert one is not None and many is not None and one != many
    assert skinny_config(8, 1024, 2048, torch.bfloat16) is None  # cuBLAS is as fast there
    assert skinny_config(17, 4096, 4096, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, MAX_M])
@pytest.mark.parametrize(
    "norm,gated,add",
    [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0)],
)
def test_fused_neighbours_equal_their_float32_references(dtype, m, norm, gated, add):
    """RMSNorm before (its weight g folded into w: rms_norm(x, g) @ w.T equals
    rsqrt(mean(x²) + eps) * (x @ (w * g).T)), silu(gate) * up after, the residual add
    after: alone and in the decoder layer's pair, against float32 torch (K = 72: not a
    tile multiple)."""
    n, k, eps = 40, 72, 1e-5
    x = _rand(m, k, dtype=dtype, seed=m) * 3
    w = _rand(2 * n if gated else n, k, dtype=dtype, seed=7) / 4
    g = (1 + _rand(k, dtype=torch.float32, seed=9) / 4).to(DEVICE)
    residual = _rand(m, n, dtype=dtype, seed=11)
    want = (rms_norm_ref(x.float(), g, eps) if norm else x.float()) @ w.float().T
    if gated:
        want = silu_and_mul_ref(want)
    if add:
        want = want + residual.float()
    w_used = (w.float() * g).to(dtype) if norm else w
    # (at one row also the one-row form, 8 rows of w a program)
    for cfg in [SkinnyConfig(16, 32, 4, 2)] + ([SkinnyConfig(8, 32, 4, 1)] if m == 1 else []):
        target = residual.clone() if add else None
        got = skinny_gemm(
            x, w_used, cfg, norm=bool(norm), eps=eps, gated=bool(gated), add_to=target
        )
        assert got.dtype == dtype and got.shape == (m, n)
        if add:
            assert got is target  # (in place)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 1e-2, (cfg, err)


def test_fused_arguments_are_checked_by_name():
    cfg = SkinnyConfig(16, 32, 4, 2)
    x = torch.zeros(2, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="odd"):
        skinny_gemm(x, torch.zeros(15, 32, dtype=torch.float16, device=DEVICE), cfg, gated=True)
    w = torch.zeros(16, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="add_to"):
        skinny_gemm(x, w, cfg, add_to=torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))


def test_fused_config_takes_the_tuned_one_else_a_default_by_rows():
    assert fused_config(1, 4096, 4096, torch.bfloat16) == skinny_config(
        1, 4096, 4096, torch.bfloat16
    )
    one, many = (
        fused_config(1, 6144, 4096, torch.bfloat16),
        fused_config(9, 6144, 4096, torch.bfloat16),
    )
    assert one.block_k > many.block_k and one.block_n == 16  # (192 blocks of 32: a thin wave)
    assert fused_config(1, 2048, 4096, torch.bfloat16).block_n == 32
    with pytest.raises(ValueError, match="17 rows"):
        fused_config(17, 4096, 4096, torch.bfloat16)


def test_fused_config_at_m1_is_the_measured_one():
    # (bench_fused_skinny.py on an H200: the fastest fused tiles for the 8B's and the
    # 0.6B's qkv, and the 0.6B's gate/up; docs/benchmarks.md)
    for n, k in ((6144, 4096), (4096, 1024)):
        assert fused_config(1, n, k, torch.bfloat16, norm=True) == SkinnyConfig(32, 512, 4, 3)
    for n, k in ((28672, 4096), (6144, 1024)):
        assert fused_config(1, n, k, torch.bfloat16, True, norm=True) == SkinnyConfig(32, 256, 4, 4)
