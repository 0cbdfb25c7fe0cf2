"""The small-batch GEMM against a float32 torch matmul (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.skinny_gemm import MAX_M, SkinnyConfig, skinny_config, skinny_gemm

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
