"""The MLA decode kernel and the latent cache write against their plain-torch
references (under the interpreter on the CPU: float32, small latents; on the GPU in the
GPU suite: DeepSeek's shapes in bfloat16, and a CUDA graph replayed after the lengths
and block tables change in place)."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.mla_decode import concat_and_cache_mla, mla_decode
from asyncllm_kernels.reference import mla_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16


def _case(seq_lens, H, L, R, dtype, seed):
    """Queries, a latent cache with shuffled block tables, the lengths (one may be 0)."""
    g = torch.Generator().manual_seed(seed)
    S = len(seq_lens)
    width = max(-(-n // BLOCK) for n in seq_lens) or 1
    num_blocks = S * width + 3
    cache = torch.randn(num_blocks, BLOCK, L + R, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: S * width].view(S, width)
    q = torch.randn(S, H, L + R, generator=g)
    put = lambda t: t.to(DEVICE)  # noqa: E731
    return (
        put(q.to(dtype)),
        put(cache.to(dtype)),
        put(table.to(torch.int32)),
        put(torch.tensor(seq_lens, dtype=torch.int32)),
    )


def _check(seq_lens, H, L, R, dtype, seed=0):
    q, cache, table, lens = _case(seq_lens, H, L, R, dtype, seed)
    scale = (L + R) ** -0.5
    got = mla_decode(q, cache, table, lens, scale, L)
    want = mla_decode_ref(q.float(), cache.float(), table, lens, scale, L)
    assert got.dtype == dtype and got.shape == (len(seq_lens), H, L)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= tol, err
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert (got[i] == 0).all()


CPU_CASES = [
    ([1, 17, 40], 4, 32, 8),  # few heads (padded to the head tile), short contexts
    ([70, 0, 5], 20, 48, 16),  # a latent off the tiles, two head tiles, an empty sequence
]


@pytest.mark.parametrize("seq_lens,H,L,R", CPU_CASES)
def test_mla_decode_equals_the_reference(seq_lens, H, L, R):
    _check(seq_lens, H, L, R, torch.float32)


def test_the_cache_write_skips_negative_slots():
    g = torch.Generator().manual_seed(3)
    kv_c, k_pe = torch.randn(3, 24, generator=g), torch.randn(3, 8, generator=g)
    cache = torch.zeros(2, BLOCK, 32)
    slots = torch.tensor([5, -1, 17])
    concat_and_cache_mla(
        kv_c.to(DEVICE), k_pe.to(DEVICE), cache := cache.to(DEVICE), slots.to(DEVICE)
    )
    flat = cache.view(-1, 32).cpu()
    assert torch.equal(flat[5], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(flat[17], torch.cat([kv_c[2], k_pe[2]]))
    written = torch.zeros(32, dtype=torch.bool)
    written[[5, 17]] = True
    assert (flat[~written] == 0).all()


GPU_CASES = [
    ([1], 16, 512, 64),  # DeepSeek-V2-Lite, batch 1, one token
    ([4096], 16, 512, 64),  # batch 1, long: the key range split over programs
    ([37, 1500, 0, 260, 9], 16, 512, 64),
    ([300, 2000], 128, 512, 64),  # DeepSeek-V3's heads
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,H,L,R", GPU_CASES + CPU_CASES)
def test_mla_decode_on_cuda(seq_lens, H, L, R, dtype):
    _check(seq_lens, H, L, R, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_mla_decode_replays_in_a_cuda_graph():
    q, cache, table, lens = _case([600, 33, 1, 900], 16, 512, 64, torch.bfloat16, seed=1)
    scale = 576**-0.5
    mla_decode(q, cache, table, lens, scale, 512)  # (compiles outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q, cache, table, lens, scale, 512)
    for seed in (2, 3):
        q2, cache2, table2, lens2 = _case([5, 900, 64, 2], 16, 512, 64, torch.bfloat16, seed)
        q.copy_(q2)
        cache.copy_(cache2[: cache.shape[0]])
        table.copy_(table2[:, : table.shape[1]] % cache.shape[0])
        lens.copy_(lens2)
        graph.replay()
        want = mla_decode_ref(q.float(), cache.float(), table, lens, scale, 512)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err <= 2e-2, err
