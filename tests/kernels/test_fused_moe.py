"""The fused mixture-of-experts kernels against the plain-torch reference (under the
interpreter on CPU, on the GPU in the GPU suite): the expert sort, and whole layers
with skewed routing (experts with no token, one expert with most), float32 and the
GPU's bfloat16."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.fused_moe import (
    GroupedConfig,
    align_slots_by_expert,
    align_slots_by_expert_torch,
    fused_moe,
    fused_moe_routed,
    fused_moe_small,
    fused_moe_sorted,
    grouped_gemm,
    softmax_topk,
)
from asyncllm_kernels.reference import fused_moe_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (the interpreter has no bfloat16)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (and it rounds through float16 on CPU where the GPU rounds through bfloat16)
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def test_the_sort_groups_each_experts_slots_in_padded_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)
    slots, experts, padded = align_slots_by_expert(ids, num_experts=5, block_m=4)
    n = ids.numel()
    # Expert 0: slots 1, 4; expert 1: 3; expert 2: 7; expert 3: 0, 2, 5, 6; expert 4: none.
    assert int(padded) == 4 * 4
    assert slots[:16].tolist() == [1, 4, n, n, 3, n, n, n, 7, n, n, n, 0, 2, 5, 6]
    assert experts[:4].tolist() == [0, 1, 2, 3]
    # Fixed sizes whatever the routing (for CUDA graphs): the rest is padding.
    assert slots.numel() == -(-(n + 5 * 3) // 4) * 4 and (slots[16:] == n).all()


def _layer(T, E, K, H, inter, dtype, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens to expert 0, none to the last two
        logits[:, 0] += 4.0
        logits[:, -2:] -= 100.0
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    put = lambda t: t.to(DEVICE)  # noqa: E731
    return (
        put(x.to(dtype)),
        put(w13.to(dtype)),
        put(w2.to(dtype)),
        put(weights.to(dtype)),
        put(ids),
    )


CASES = [
    (1, 8, 2, 64, 32, False),  # a decode step
    (5, 8, 2, 48, 40, True),  # dimensions off the tiles, skewed routing
    (70, 16, 4, 64, 32, True),  # larger tiles (more slots per expert)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,K,H,inter,skew", CASES)
def test_fused_moe_equals_the_reference(dtype, T, E, K, H, inter, skew):
    _check(dtype, T, E, K, H, inter, skew)


@pytest.mark.gpu  # (the same cases on the GPU suite's run, bfloat16 too)
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,H,inter,skew", CASES)
def test_fused_moe_on_cuda(dtype, T, E, K, H, inter, skew):
    _check(dtype, T, E, K, H, inter, skew)


def _check(dtype, T, E, K, H, inter, skew):
    x, w13, w2, weights, ids = _layer(T, E, K, H, inter, dtype, seed=T, skew=skew)
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert got.dtype == dtype and got.shape == (T, H)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= tol, err


SMALL_TILES = [
    None,
    (GroupedConfig(16, 16, 4, 2), GroupedConfig(32, 16, 2, 3)),
    # (tiles of fewer than 16 rows: products summed along K, not tl.dot)
    (GroupedConfig(4, 32, 2, 1), GroupedConfig(4, 32, 2, 1)),
    (GroupedConfig(1, 16, 4, 1), GroupedConfig(8, 16, 4, 1)),
]


@pytest.mark.parametrize("tiles", SMALL_TILES)
@pytest.mark.parametrize("T,skew", [(1, False), (3, True), (4, False)])
def test_the_small_batch_path_equals_the_sorted_one_and_the_reference(tiles, T, skew):
    # (H and inter off the tiles; with 16-wide K tiles each down program walks several
    # tiles of each of its token's experts in one loop)
    E, K, H, inter = 8, 3, 48, 40
    x, w13, w2, weights, ids = _layer(T, E, K, H, inter, torch.float32, seed=T, skew=skew)
    small = fused_moe_small(x, w13, w2, weights, ids, tiles)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert small.shape == (T, H)
    assert torch.allclose(small, want, rtol=1e-4, atol=1e-5)
    assert torch.allclose(fused_moe_sorted(x, w13, w2, weights, ids), want, rtol=1e-4, atol=1e-5)


ROUTINGS = [(False, 1.0, None), (True, 1.0, None), (False, 2.5, None), (True, 1.0, HALF)]


@pytest.mark.parametrize("T", [1, 3, 4, 6])
@pytest.mark.parametrize("renormalize,scaling,round_to", ROUTINGS)
@pytest.mark.parametrize("by_rank", [True, False])
def test_routing_inside_the_gemm_equals_the_routing_kernel_then_the_layer(
    T, renormalize, scaling, round_to, by_rank
):
    """`fused_moe_routed`: up to SMALL_BATCH_TOKENS tokens the gate/up programs route
    their tokens themselves; past it (6) the routing kernel runs, then the sorted path.
    Either way the layer of `softmax_topk`'s routing. The logits are strided (a view) and
    E is off a power of two. Both ways of ranking the experts."""
    _check_routed(T, renormalize, scaling, round_to, torch.float32, by_rank=by_rank)


@pytest.mark.parametrize("by_rank", [True, False])
def test_routing_inside_the_gemm_breaks_ties_and_nans_as_the_routing_kernel(by_rank):
    """Rows of equal logits (the lowest ids win), of NaN and of infinities route as
    `softmax_topk` routes them (not renormalised: the last two rows' weights are 0)."""
    T, E = 4, 10
    logits = torch.randn(T, E)
    logits[0] = 0.5
    logits[1, 3] = float("nan")
    logits[2, 4:7] = float("inf")
    logits[3, 2:8] = 1.0
    _check_routed(T, False, 1.0, None, torch.float32, logits=logits.to(DEVICE), by_rank=by_rank)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 2, 4])
def test_routing_inside_the_gemm_rounds_through_bfloat16_on_cuda(T):
    _check_routed(T, True, 1.0, torch.bfloat16, torch.bfloat16)


def _check_routed(T, renormalize, scaling, round_to, dtype, logits=None, by_rank=True):
    E, K, H, inter = 10, 3, 48, 40
    x, w13, w2, _, _ = _layer(T, E, K, H, inter, dtype, seed=T)
    if logits is None:
        g = torch.Generator().manual_seed(T + 100)
        logits = torch.randn(T, 2 * E, generator=g).to(DEVICE)[:, ::2]
    weights, ids = softmax_topk(logits, K, renormalize, scaling, round_to)
    got = fused_moe_routed(x, w13, w2, logits, K, renormalize, scaling, round_to, by_rank)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.shape == (T, H) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert ((got.float() - want).norm() / want.norm()).item() <= tol
    close = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    assert torch.allclose(got, fused_moe(x, w13, w2, weights, ids), **close)


@pytest.mark.parametrize("config", [None, GroupedConfig(16, 32, 4, 3), GroupedConfig(32, 16, 2, 2)])
def test_the_gated_grouped_gemm_writes_silu_of_gate_times_up(config):
    T, E, K, H, inter = 3, 4, 2, 40, 24  # (H and inter off the tiles)
    x, w13, _, _, ids = _layer(T, E, K, H, inter, torch.float32, seed=7)
    a = torch.full((T * K, inter), float("nan"), device=DEVICE)
    grouped_gemm(x, w13, a, align_slots_by_expert(ids, E, 16), None, K, 16, True, config)
    for s, e in enumerate(ids.flatten().tolist()):
        h = x[s // K] @ w13[e].T
        want = torch.nn.functional.silu(h[:inter]) * h[inter:]
        assert torch.allclose(a[s], want, rtol=1e-4, atol=1e-5), s


def test_no_tokens_give_an_empty_output():
    x, w13, w2, weights, ids = _layer(1, 4, 2, 16, 16, torch.float32, seed=0)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)


@pytest.mark.parametrize("T,K,E,block_m", [(1, 6, 64, 16), (7, 2, 5, 4), (120, 8, 128, 32)])
def test_the_one_program_sort_equals_the_torch_one(T, K, E, block_m):
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[: T // 2, 0] = 1  # a crowded expert (and some with no slot)
    ids = ids.to(DEVICE)
    got = align_slots_by_expert(ids, E, block_m)
    want = align_slots_by_expert_torch(ids, E, block_m)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.dtype == w_.dtype and torch.equal(g_, w_)


@pytest.mark.parametrize(
    "renormalize,scaling,round_to",
    [(False, 1.0, None), (True, 1.0, None), (False, 1.5, None), (True, 1.0, HALF)],
)
def test_the_routing_kernel_equals_softmax_and_topk(renormalize, scaling, round_to):
    _check_routing(renormalize, scaling, round_to)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_the_routing_kernel_rounds_through_bfloat16_on_cuda():
    _check_routing(True, 1.0, torch.bfloat16)


def _check_routing(renormalize, scaling, round_to):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 20, generator=g).to(DEVICE)
    weights, ids = softmax_topk(logits, 3, renormalize, scaling, round_to)
    probs = torch.softmax(logits.float(), -1)
    want_w, want_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    want_w = want_w * scaling
    assert torch.equal(ids, want_ids)
    assert weights.dtype == torch.float32
    if round_to is None:
        assert torch.allclose(weights, want_w, rtol=1e-5, atol=1e-7)
    else:  # (each weight a value of the half type: the nearest to the float32 one)
        assert torch.equal(weights, weights.to(round_to).float())
        assert torch.allclose(weights, want_w.to(round_to).float(), rtol=1e-2, atol=0)
        assert (weights != want_w).any()  # (rounded, not passed through)


def test_the_routing_kernel_gives_valid_experts_for_rows_of_nan_or_inf():
    """A token whose router logits hold a NaN or an infinity (a diverged activation, as
    random weights can give) still gets k distinct experts in range: an id past the last
    expert made a later gather fail a device-side assert and killed the engine. Its
    weights may be NaN; the other tokens' routing is unchanged."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 20, generator=g)
    want_w, want_ids = softmax_topk(logits.to(DEVICE), 4, True)
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    logits[3, 2] = float("inf")
    logits[4, :3] = float("-inf")
    weights, ids = softmax_topk(logits.to(DEVICE), 4, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < 20)).all(), ids
    assert all(len(set(row.tolist())) == 4 for row in ids), ids
    assert torch.equal(ids[0], want_ids[0].cpu())
    assert torch.equal(weights[0], want_w[0])
    assert not set(ids[4].tolist()) & {0, 1, 2}  # (-inf: probability 0, never before the rest)


def test_the_routing_kernel_refuses_other_rounding_types():
    logits = torch.randn(2, 8).to(DEVICE)
    with pytest.raises(ValueError, match="round_to"):
        softmax_topk(logits, 2, True, round_to=torch.float64)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(logits, 9, True)
