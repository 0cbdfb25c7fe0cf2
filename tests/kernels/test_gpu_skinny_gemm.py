"""The small-batch GEMM compiled for the GPU on every tuned shape, for each M of 1-16,
against a float32 matmul of the same bf16 inputs; and the layers' choice of it."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.skinny_gemm import MAX_M, TUNED, skinny_config, skinny_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("shape", sorted(TUNED))
def test_tuned_shapes_equal_a_float32_matmul(shape):
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    largest = TUNED[shape][-1][0]
    for m in range(1, MAX_M + 1):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        cfg = skinny_config(m, n, k, torch.bfloat16)
        assert (cfg is None) == (m > largest)
        if cfg is None:
            continue
        got = skinny_gemm(x, w, cfg).float()
        want = x.float() @ w.float().T
        assert ((got - want).norm() / want.norm()).item() <= 4e-3, (m, cfg)


def test_a_tuned_linear_layer_takes_it_for_small_batches_and_cublas_beyond():
    from asyncllm.model.layers.linear import RowParallelLinear

    layer = RowParallelLinear(2048, 1024).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1024, 2048, device="cuda") / 2048**0.5)
    for m in (1, 3, 7, 8, 64):
        x = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
        want = x.float() @ layer.weight.float().T
        got = layer(x).float()
        assert ((got - want).norm() / want.norm()).item() <= 4e-3, m
        cfg = skinny_config(m, 1024, 2048, torch.bfloat16)
        assert (cfg is not None) == (m <= 7), m
        path = (
            skinny_gemm(x, layer.weight, cfg)
            if cfg
            else torch.nn.functional.linear(x, layer.weight)
        )
        assert torch.equal(layer(x), path), m  # the layer ran that kernel
