"""The paged attention kernel against its torch reference: chunks after cached context,
decodes, GQA group sizes 1-8 (not only powers of two), sliding window, soft-cap."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.paged_attention import paged_attention, paged_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(group, dtype, block_size=16, head=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hkv = 2
    seqs = [(1, 37), (5, 5), (17, 50), (1, 1)]  # (query len, total len)
    num_blocks = 32
    perm = torch.randperm(num_blocks, generator=g)
    tables, used = [], 0
    for _, n in seqs:
        nb = -(-n // block_size)
        tables.append(perm[used : used + nb].tolist())
        used += nb
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kc = torch.randn(num_blocks, block_size, Hkv, head, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, Hkv, head, generator=g).to(dtype)
    qlens = [q for q, _ in seqs]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), Hkv * group, head, generator=g).to(dtype)
    token_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(qlens)).to(
        torch.int32
    )
    seq_lens = torch.tensor([n for _, n in seqs], dtype=torch.int32)
    to = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    return to(q, kc, vc, bt, seq_lens, qsl, token_seq)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(group, dtype):
    q, kc, vc, bt, sl, qsl, ts = _case(group, dtype)
    got = paged_attention(q, kc, vc, bt, sl, qsl, ts, scale=0.125)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, scale=0.125)
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,cap", [(20, None), (None, 10.0), (7, 30.0)])
def test_window_and_soft_cap(window, cap):
    q, kc, vc, bt, sl, qsl, ts = _case(2, torch.float32, seed=1)
    got = paged_attention(
        q, kc, vc, bt, sl, qsl, ts, scale=0.125, sliding_window=window, soft_cap=cap
    )
    want = paged_attention_ref(
        q, kc, vc, bt, sl, qsl, scale=0.125, sliding_window=window, soft_cap=cap
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_block_size_32_and_head_128():
    q, kc, vc, bt, sl, qsl, ts = _case(2, torch.float32, block_size=32, head=128, seed=2)
    got = paged_attention(q, kc, vc, bt, sl, qsl, ts, scale=128**-0.5)
    want = paged_attention_ref(q, kc, vc, bt, sl, qsl, scale=128**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
