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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_the_per_head_norm_fused_before_the_rotation(dtype, is_neox):
    """Qwen3's q_norm and k_norm, then the rotation, in one launch on views of a fused
    qkv output: the unfused path's norms (`rms_norm_ref` per head) then its rotation."""
    from asyncllm_kernels.reference import rms_norm_ref

    g = torch.Generator().manual_seed(2)
    T, Hq, Hk, D = 5, 6, 2, 64
    qkv = (3 * torch.randn(T, (Hq + 2 * Hk) * D, generator=g)).to(dtype).to(DEVICE)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    wq = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    wk = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    v_before = qkv[:, (Hq + Hk) * D :].clone()
    pos = torch.tensor([0, 9, 3, 255, 40], device=DEVICE)
    cache = _cache(256, D)
    want_q = apply_rotary_ref(pos, rms_norm_ref(q, wq, 1e-6), cache, is_neox)
    want_k = apply_rotary_ref(pos, rms_norm_ref(k, wk, 1e-6), cache, is_neox)
    apply_rotary_(pos, q, k, cache, is_neox, norm_weights=(wq, wk), eps=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (Hq + Hk) * D :], v_before)
    with pytest.raises(ValueError, match="whole heads"):
        apply_rotary_(pos, q, k, _cache(256, 32), is_neox, norm_weights=(wq, wk))
