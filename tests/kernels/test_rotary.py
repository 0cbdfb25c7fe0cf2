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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norm", [False, True])
def test_the_kv_cache_write_fused_with_the_rotation(dtype, is_neox, norm):
    """q rotated in place; k rotated and v copied into the paged cache at each token's
    slot (negative slots and tokens past the slot list write nothing), on views of a
    fused qkv output: the unfused path's (norms,) rotation, then `reshape_and_cache_ref`."""
    from asyncllm_kernels.reference import reshape_and_cache_ref, rms_norm_ref
    from asyncllm_kernels.rotary import rotate_into_kv_cache_

    g = torch.Generator().manual_seed(3)
    T, Hq, Hk, D, blocks, bs = 7, 6, 2, 64, 4, 4
    qkv = (3 * torch.randn(T, (Hq + 2 * Hk) * D, generator=g)).to(dtype).to(DEVICE)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(T, Hk, D)
    weights = None
    want_q, want_k = q.clone(), k.clone()
    if norm:
        weights = tuple((1 + 0.5 * torch.randn(D, generator=g)).to(dtype).to(DEVICE) for _ in "qk")
        want_q, want_k = rms_norm_ref(q, weights[0], 1e-6), rms_norm_ref(k, weights[1], 1e-6)
    pos = torch.tensor([0, 9, 3, 255, 40, 1, 2], device=DEVICE)
    cache = _cache(256, D)
    want_q = apply_rotary_ref(pos, want_q, cache, is_neox)
    want_k = apply_rotary_ref(pos, want_k, cache, is_neox)
    # Token 2 is padding (slot -1); token 6 has no slot (T = 7, six slots).
    slots = torch.tensor([5, 0, -1, 15, 8, 9], device=DEVICE)
    kv = torch.full((2, blocks, bs, Hk, D), 7.0, dtype=dtype, device=DEVICE)
    want_kv = kv.clone()
    reshape_and_cache_ref(want_k[:6], v[:6], want_kv[0], want_kv[1], slots)
    k_before = k.clone()
    rotate_into_kv_cache_(
        pos, q, k, v, cache, kv[0], kv[1], slots, is_neox, norm_weights=weights, eps=1e-6
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(kv, want_kv, atol=tol, rtol=tol)
    assert torch.equal(k, k_before)  # k is left as it was
    # Slots the step does not name keep their old contents exactly.
    written = torch.zeros(blocks * bs, dtype=torch.bool)
    written[[5, 0, 15, 8, 9]] = True
    assert (kv[:, ~written.view(blocks, bs).to(DEVICE)] == 7.0).all()


def test_the_fused_kv_cache_write_refuses_what_it_cannot_do():
    from asyncllm_kernels.rotary import rotate_into_kv_cache_

    T, H, D = 3, 2, 64
    q, k, v = (torch.zeros(T, H, D, device=DEVICE) for _ in range(3))
    kv = torch.zeros(2, 2, 4, H, D, device=DEVICE)
    slots = torch.arange(T, device=DEVICE)
    with pytest.raises(ValueError, match="whole heads"):
        rotate_into_kv_cache_(slots, q, k, v, _cache(8, 32), kv[0], kv[1], slots)
    with pytest.raises(ValueError, match="key_cache"):
        rotate_into_kv_cache_(slots, q, k, v, _cache(8, D), kv[0][..., :32], kv[1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotate_into_kv_cache_(slots, q, k, v, _cache(8, D), kv[0], kv[1], slots.int())
