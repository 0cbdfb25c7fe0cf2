"""The row-wise kernels and the rotary compiled for the GPU, in bfloat16 and float16, against
their torch references computed in float32 on the upcast inputs; then each one captured in
a CUDA graph and replayed on new inputs copied into the captured buffers.

Outputs the kernels allocate are poisoned with NaN (torch.empty and torch.empty_like return
NaN-filled tensors while a kernel runs), and caches are NaN-filled, so any element a
kernel fails to write shows up.
"""

from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

from asyncllm_kernels.elementwise import reshape_and_cache, rms_norm, silu_and_mul
from asyncllm_kernels.reference import (
    apply_rotary_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from asyncllm_kernels.rotary import apply_rotary_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16
TOL = 1e-2
EPS = 1e-6
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh inputs per case, reproducible per test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape
    assert not out.isnan().any(), "output not fully written"
    err = rel_err(out, ref)
    assert err <= TOL, f"relative error {err:.2e}"


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(dtype)


@contextlib.contextmanager
def _nan_allocations():
    """While active, torch.empty / torch.empty_like return NaN-filled float tensors."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(alloc):
        def wrapper(*args, **kwargs):
            t = alloc(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t

        return wrapper

    torch.empty, torch.empty_like = poisoned(empty), poisoned(empty_like)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _capture(fn):
    """torch's documented pattern: warm up on a side stream, then capture. Returns the
    graph and what `fn` returned during capture (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# --- reshape_and_cache ----------------------------------------------------------------


def _slots(T: int, num_blocks: int, pad: int) -> torch.Tensor:
    """T distinct shuffled slots of the cache, `pad` of them (at random rows) set to -1."""
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:T].clone()
    slots[torch.randperm(T, device=DEV)[:pad]] = -1
    return slots


def _cache_pair(num_blocks, heads, head, dtype):
    shape = (num_blocks, BLOCK_SIZE, heads, head)
    return [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for _ in range(2)]


def _check_cache(T, heads, head, k, v, kc, vc, slots):
    live = int((slots >= 0).sum())
    kc_ref, vc_ref = _cache_pair(kc.shape[0], heads, head, torch.float32)
    reshape_and_cache_ref(k.float(), v.float(), kc_ref, vc_ref, slots)
    for got, want in ((kc, kc_ref), (vc, vc_ref)):
        # A copy: exact, and every slot not written (including those of -1 rows) still NaN.
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0, equal_nan=True)
        written = ~got.isnan().flatten(0, 1).all(-1).all(-1)
        assert int(written.sum()) == live
        assert rel_err(got.flatten(0, 1)[written], want.flatten(0, 1)[written]) <= TOL


@pytest.mark.parametrize(
    "dtype,T,heads,head,pad",
    [(BF16, 1, 8, 128, 0), (FP16, 7, 2, 80, 2), (BF16, 300, 8, 128, 37)],
)
def test_reshape_and_cache(dtype, T, heads, head, pad):
    num_blocks = -(-2 * T // BLOCK_SIZE) + 1
    k, v = _randn(T, heads, head, dtype=dtype), _randn(T, heads, head, dtype=dtype)
    slots = _slots(T, num_blocks, pad)
    kc, vc = _cache_pair(num_blocks, heads, head, dtype)
    k0, v0 = k.clone(), v.clone()
    reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    _check_cache(T, heads, head, k, v, kc, vc, slots)


def test_reshape_and_cache_cuda_graph():
    T, heads, head, dtype = 33, 8, 128, BF16
    num_blocks = -(-2 * T // BLOCK_SIZE)
    k, v = _randn(T, heads, head, dtype=dtype), _randn(T, heads, head, dtype=dtype)
    slots = _slots(T, num_blocks, 5)
    kc, vc = _cache_pair(num_blocks, heads, head, dtype)
    graph, _ = _capture(lambda: reshape_and_cache(k, v, kc, vc, slots))

    k.copy_(_randn(T, heads, head, dtype=dtype))
    v.copy_(_randn(T, heads, head, dtype=dtype))
    slots.copy_(_slots(T, num_blocks, 9))
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_cache(T, heads, head, k, v, kc, vc, slots)


# --- rms_norm -------------------------------------------------------------------------


def _rms_norm_ref32(x, w, residual):
    res32 = residual.float() if residual is not None else None
    out = rms_norm_ref(x.float(), w.float(), EPS, res32)
    return out, res32


@pytest.mark.parametrize(
    "dtype,T,hidden,with_residual",
    [
        (BF16, 1, 1024, False),
        (BF16, 7, 1024, True),
        (FP16, 300, 1000, True),
        (FP16, 7, 128, False),
    ],
)
def test_rms_norm(dtype, T, hidden, with_residual):
    x, w = _randn(T, hidden, dtype=dtype), _randn(hidden, dtype=dtype)
    res = _randn(T, hidden, dtype=dtype) if with_residual else None
    want, res_want = _rms_norm_ref32(x, w, res)
    x0 = x.clone()
    with _nan_allocations():
        out = rms_norm(x, w, EPS, res)
    assert out.dtype == dtype
    _check(out, want)
    assert torch.equal(x, x0)
    if with_residual:
        _check(res, res_want)


def test_rms_norm_cuda_graph():
    T, hidden, dtype = 40, 1024, BF16
    x, w, res = (_randn(*s, dtype=dtype) for s in ((T, hidden), (hidden,), (T, hidden)))
    graph, out = _capture(lambda: rms_norm(x, w, EPS, res))

    x.copy_(_randn(T, hidden, dtype=dtype))
    w.copy_(_randn(hidden, dtype=dtype))
    res.copy_(_randn(T, hidden, dtype=dtype))
    want, res_want = _rms_norm_ref32(x, w, res)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, want)
    _check(res, res_want)


# --- silu_and_mul ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype,T,d", [(BF16, 1, 3072), (FP16, 7, 2500), (BF16, 300, 8)])
def test_silu_and_mul(dtype, T, d):
    x = _randn(T, 2 * d, dtype=dtype)
    want = silu_and_mul_ref(x.float())
    with _nan_allocations():
        out = silu_and_mul(x)
    assert out.dtype == dtype
    _check(out, want)


def test_silu_and_mul_cuda_graph():
    T, d, dtype = 24, 3072, BF16
    x = _randn(T, 2 * d, dtype=dtype)
    graph, out = _capture(lambda: silu_and_mul(x))

    x.copy_(_randn(T, 2 * d, dtype=dtype))
    want = silu_and_mul_ref(x.float())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, want)


# --- rotary ---------------------------------------------------------------------------


def _cos_sin_cache(max_pos: int, rot_dim: int, theta: float = 1e6) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, device=DEV).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, device=DEV).float(), inv)
    return torch.cat([freqs.cos(), freqs.sin()], -1)


def _check_rotary(q_out, k_out, q_in, k_in, pos, cache, is_neox):
    rot_dim = cache.shape[-1]
    for out, x in ((q_out, q_in), (k_out, k_in)):
        want = apply_rotary_ref(pos, x.float(), cache, is_neox)
        _check(out, want)
        # Dimensions past rot_dim are left exactly as they were.
        assert torch.equal(out[..., rot_dim:], x[..., rot_dim:])


@pytest.mark.parametrize(
    "dtype,is_neox,T,hq,hk,head,rot_dim",
    [
        (BF16, True, 7, 16, 8, 128, 128),
        (BF16, False, 300, 16, 8, 128, 128),
        (FP16, True, 1, 4, 2, 128, 64),
        (FP16, False, 7, 4, 1, 64, 32),
        (BF16, False, 7, 4, 2, 128, 96),
    ],
    ids=["neox", "gptj", "neox-partial", "gptj-partial", "gptj-partial-96"],
)
def test_rotary(dtype, is_neox, T, hq, hk, head, rot_dim):
    max_pos = 4096
    cache = _cos_sin_cache(max_pos, rot_dim)
    pos = torch.randint(0, max_pos, (T,), device=DEV)
    q, k = _randn(T, hq, head, dtype=dtype), _randn(T, hk, head, dtype=dtype)
    q_in, k_in = q.clone(), k.clone()
    apply_rotary_(pos, q, k, cache, is_neox)
    _check_rotary(q, k, q_in, k_in, pos, cache, is_neox)


def test_rotary_cuda_graph():
    T, hq, hk, head, max_pos, dtype = 50, 16, 8, 128, 4096, BF16
    cache = _cos_sin_cache(max_pos, head)
    pos = torch.randint(0, max_pos, (T,), device=DEV)
    q, k = _randn(T, hq, head, dtype=dtype), _randn(T, hk, head, dtype=dtype)
    graph, _ = _capture(lambda: apply_rotary_(pos, q, k, cache, True))

    pos.copy_(torch.randint(0, max_pos, (T,), device=DEV))
    q.copy_(_randn(T, hq, head, dtype=dtype))
    k.copy_(_randn(T, hk, head, dtype=dtype))
    q_in, k_in = q.clone(), k.clone()
    graph.replay()
    torch.cuda.synchronize()
    _check_rotary(q, k, q_in, k_in, pos, cache, True)


# --- rotary with the KV cache write ---------------------------------------------------


def _unfused(pos, q, k, v, cache, is_neox, weights, kc, vc, slots):
    """The launches the fused one replaces: the rotation (with the norms) in place on
    copies, then `reshape_and_cache`; returns the rotated q."""
    q, k = q.clone(), k.clone()
    apply_rotary_(pos, q, k, cache, is_neox, norm_weights=weights)
    reshape_and_cache(k[: len(slots)], v[: len(slots)], kc, vc, slots)
    return q


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_into_the_kv_cache_equals_the_unfused_launches(norm, is_neox):
    """The rotation then `reshape_and_cache` (the same values up to rounding, the same
    slots written), on views of a fused qkv output, padding slots (-1) and rows past the
    slots included; k itself untouched."""
    from asyncllm_kernels.rotary import rotate_into_kv_cache_

    T, hq, hk, head, num_blocks, dtype = 37, 16, 8, 128, 8, BF16
    cache = _cos_sin_cache(4096, head)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    qkv = _randn(T, (hq + 2 * hk) * head, dtype=dtype)
    q = qkv[:, : hq * head].view(T, hq, head)
    k = qkv[:, hq * head : (hq + hk) * head].view(T, hk, head)
    v = qkv[:, (hq + hk) * head :].view(T, hk, head)
    weights = (_randn(head, dtype=dtype), _randn(head, dtype=dtype)) if norm else None
    slots = _slots(T - 3, num_blocks, 4)  # the last 3 rows: graph padding, no slot
    want_kv = _cache_pair(num_blocks, hk, head, dtype)
    want_q = _unfused(pos, q, k, v, cache, is_neox, weights, *want_kv, slots)
    k0 = k.clone()
    kc, vc = _cache_pair(num_blocks, hk, head, dtype)
    rotate_into_kv_cache_(pos, q, k, v, cache, kc, vc, slots, is_neox, weights)
    torch.testing.assert_close(q, want_q, rtol=TOL, atol=TOL)
    assert torch.equal(k, k0)
    for got, want in zip((kc, vc), want_kv, strict=True):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, equal_nan=True)


def test_rotary_into_the_kv_cache_cuda_graph():
    """Captured once, replayed with new positions, inputs and slots copied in place."""
    from asyncllm_kernels.rotary import rotate_into_kv_cache_

    T, hq, hk, head, num_blocks, dtype = 33, 16, 8, 128, 6, BF16
    cache = _cos_sin_cache(4096, head)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    q, k, v = (_randn(T, h, head, dtype=dtype) for h in (hq, hk, hk))
    slots = _slots(T, num_blocks, 5)
    kc, vc = _cache_pair(num_blocks, hk, head, dtype)
    graph, _ = _capture(lambda: rotate_into_kv_cache_(pos, q, k, v, cache, kc, vc, slots))

    pos.copy_(torch.randint(0, 4096, (T,), device=DEV))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
    slots.copy_(_slots(T, num_blocks, 9))
    want_kv = _cache_pair(num_blocks, hk, head, dtype)
    want_q = _unfused(pos, q, k, v, cache, True, None, *want_kv, slots)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(q, want_q, rtol=TOL, atol=TOL)
    for got, want in zip((kc, vc), want_kv, strict=True):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, equal_nan=True)
