"""KV cache write, fused residual + RMSNorm and SiluAndMul against their torch references."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.elementwise import reshape_and_cache, rms_norm, silu_and_mul
from asyncllm_kernels.reference import reshape_and_cache_ref, rms_norm_ref, silu_and_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_size", [(1, 16), (3, 64)])
def test_reshape_and_cache_writes_slots_and_skips_negative_ones(dtype, heads, head_size):
    T, num_blocks, bs = 7, 6, 4
    k, v = _rand(T, heads, head_size, dtype=dtype), _rand(T, heads, head_size, dtype=dtype, seed=1)
    slots = torch.tensor([5, 0, -1, 23, 9, -1, 12], device=DEVICE)
    caches = [
        torch.full((num_blocks, bs, heads, head_size), -7.0, dtype=dtype, device=DEVICE)
        for _ in range(4)
    ]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert (caches[0] == -7.0).sum() == (
        num_blocks * bs - 5
    ) * heads * head_size  # only 5 slots written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    x, w = _rand(5, hidden, dtype=dtype), _rand(hidden, dtype=dtype, seed=2)
    res = _rand(5, hidden, dtype=dtype, seed=3) if with_residual else None
    res_ref = res.clone() if with_residual else None
    got = rms_norm(x, w, 1e-6, res)
    want = rms_norm_ref(x, w, 1e-6, res_ref)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)
    if with_residual:
        torch.testing.assert_close(res, res_ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 1536, 1000])
def test_silu_and_mul(dtype, d):
    x = _rand(3, 2 * d, dtype=dtype)
    torch.testing.assert_close(
        silu_and_mul(x).float(),
        silu_and_mul_ref(x).float(),
        atol=TOL[dtype] * 4,
        rtol=TOL[dtype] * 4,
    )
