"""Rotary embedding kernel (in place, both layouts, partial rotary) against its reference."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.reference import apply_rotary_ref
from asyncllm_kernels.rotary import apply_rotary_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (128, 64)])
def test_rotary_matches_reference(dtype, is_neox, head_size, rot_dim):
    g = torch.Generator().manual_seed(0)
    T, Hq, Hk = 6, 4, 2
    q = torch.randn(T, Hq, head_size, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(T, Hk, head_size, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor([0, 1, 7, 100, 3, 511], device=DEVICE)
    cache = _cache(512, rot_dim)
    want_q, want_k = (
        apply_rotary_ref(pos, q, cache, is_neox),
        apply_rotary_ref(pos, k, cache, is_neox),
    )
    apply_rotary_(pos, q, k, cache, is_neox)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)


def test_rotary_works_on_views_of_a_fused_qkv_output():
    g = torch.Generator().manual_seed(1)
    T, Hq, Hk, D = 5, 3, 1, 64
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(DEVICE)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v_before = qkv[:, (Hq + Hk) * D :].clone()
    pos = torch.arange(T, device=DEVICE)
    cache = _cache(16, D)
    want_q, want_k = apply_rotary_ref(pos, q, cache), apply_rotary_ref(pos, k, cache)
    apply_rotary_(pos, q, k, cache)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], v_before)  # v untouched
