"""The paged attention kernel against its torch reference, under the interpreter on CPU:
chunks after cached context, decodes, GQA group sizes 1-8 (not only powers of two),
sliding window, soft-cap, the KV split with its merge, padded batches."""

from __future__ import annotations

import pytest
import torch

from asyncllm_kernels.paged_attention import (
    SHORT_QUERY,
    AttentionConfig,
    choose_config,
    paged_attention,
    short_launch,
)
from asyncllm_kernels.reference import paged_attention_ref
from tests.kernels.attention_cases import make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = [(1, 37), (5, 5), (17, 50), (1, 1), (20, 200)]  # (query length, total length)
DECODES = [(1, 37), (1, 1), (1, 130), (1, 64)]
# A speculative verification's batch: 1 + drafts per request, some with no drafts.
SHORT = [(5, 300), (3, 40), (1, 1), (5, 5), (4, 130), (1, 64)]


def _check(case, dtype, **kw):
    got = paged_attention(
        *case.args(), scale=0.125, max_query_len=case.max_query_len,
        has_decodes=case.has_decodes, **kw,
    )  # fmt: skip
    kw.pop("config", None)
    want = paged_attention_ref(*case.args(), scale=0.125, **kw)
    n = case.num_tokens
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch(group, dtype):
    _check(make_case(MIXED, 2, group, 64, 16, dtype, DEVICE, seed=group), dtype)


@pytest.mark.parametrize("group,splits", [(2, 1), (2, 4), (3, 2), (8, 8)])
def test_decode_batch_with_kv_split(group, splits):
    case = make_case(DECODES, 2, group, 64, 16, torch.float32, DEVICE, seed=splits)
    config = AttentionConfig(block_m=16, block_n=16, num_splits=splits, num_warps=4, num_stages=1)
    _check(case, torch.float32, config=config)


def test_long_decode_uses_more_than_16_splits():
    """Past 16 splits a split is used only once each has SPLIT_TILES key tiles: 150
    tiles over 32 splits use 17 of them, 10 tiles use 10; the rest are empty and the
    merge skips them."""
    case = make_case([(1, 2400), (1, 150)], 1, 2, 64, 16, torch.float32, DEVICE, seed=11)
    config = AttentionConfig(block_m=16, block_n=16, num_splits=32, num_warps=4, num_stages=1)
    _check(case, torch.float32, config=config)


@pytest.mark.parametrize("window,cap", [(20, None), (None, 10.0), (7, 30.0)])
def test_window_and_soft_cap(window, cap):
    case = make_case(MIXED, 2, 2, 64, 16, torch.float32, DEVICE, seed=1)
    _check(case, torch.float32, sliding_window=window, soft_cap=cap)


def test_split_with_window():
    case = make_case(DECODES, 2, 2, 64, 16, torch.float32, DEVICE, seed=5)
    config = AttentionConfig(block_m=16, block_n=16, num_splits=4, num_warps=4, num_stages=1)
    _check(case, torch.float32, config=config, sliding_window=40)


def test_block_size_32_head_128_small_tiles():
    case = make_case(MIXED, 2, 2, 128, 32, torch.float32, DEVICE, seed=2)
    config = AttentionConfig(block_m=16, block_n=32, num_splits=1, num_warps=4, num_stages=1)
    _check(case, torch.float32, config=config)


def test_head_not_power_of_two():
    _check(make_case(MIXED, 1, 2, 80, 16, torch.float32, DEVICE, seed=3), torch.float32)


def test_padded_batch_leaves_padding_alone():
    """Empty sequences and rows past the last chunk (a padded graph batch) are skipped."""
    case = make_case(DECODES, 2, 2, 64, 16, torch.float32, DEVICE, pad_seqs=3, pad_tokens=3)
    for splits in (1, 2):
        out = torch.full_like(case.q, 7.0)
        config = AttentionConfig(16, 16, splits, 4, 1)
        paged_attention(*case.args(), scale=0.125, max_query_len=1, out=out, config=config)
        assert torch.all(out[case.num_tokens :] == 7.0)
        want = paged_attention_ref(*case.args(), scale=0.125)
        n = case.num_tokens
        torch.testing.assert_close(out[:n], want[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 50])
def test_mixed_batch_in_two_launches(window):
    """Decodes and a longer chunk: a decode-tile launch (here with a KV split: few
    programs) and a prefill-tile launch, each skipping the other's sequences."""
    case = make_case([(1, 130), (20, 200), (1, 70)], 1, 2, 64, 16, torch.float32, DEVICE, seed=7)
    assert case.has_decodes and case.max_query_len > 1
    _check(case, torch.float32, sliding_window=window)


def test_bad_arguments_are_refused():
    case = make_case(DECODES, 2, 2, 64, 16, torch.float32, DEVICE)
    args = case.args()
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*args, scale=0.1, max_query_len=1, sliding_window=0)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention(*args, scale=0.1, max_query_len=1, soft_cap=0.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*args, scale=0.1, max_query_len=1, config=AttentionConfig(16, 16, 3, 4, 1))
    mixed = make_case(MIXED, 2, 2, 64, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="one query tile"):
        paged_attention(
            *mixed.args(), scale=0.1, max_query_len=mixed.max_query_len,
            config=AttentionConfig(16, 16, 2, 4, 1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="head"):
        paged_attention(args[0].transpose(1, 2), *args[1:], scale=0.1, max_query_len=1)


def test_the_kernel_variants():
    """Key tiles loaded as rows, and the running sums rescaled only when a row's maximum
    grew past 2^8 (with q x 40 the scores span hundreds, so rescales happen mid-row),
    both on (each is its own constexpr branch): a mixed batch with a window and a
    soft-cap, a head size of 80 (masked head dims), and decodes split."""
    config = AttentionConfig(32, 16, 1, 4, 1, k_rows=True, lazy_rescale=True)
    case = make_case(MIXED, 2, 2, 64, 16, torch.float32, DEVICE, seed=9)
    odd = make_case(MIXED, 2, 2, 80, 16, torch.float32, DEVICE, seed=12)
    decodes = make_case(DECODES, 2, 2, 64, 16, torch.float32, DEVICE, seed=10)
    for c in (case, odd, decodes):
        c.q.mul_(40.0)
    for kw in ({}, {"sliding_window": 30}, {"soft_cap": 20.0}):
        _check(case, torch.float32, config=config, **kw)
    _check(odd, torch.float32, config=config)
    split = AttentionConfig(16, 16, 4, 4, 1, k_rows=True, lazy_rescale=True)
    _check(decodes, torch.float32, config=split)


def test_decodes_and_chunks_by_themselves():
    """rows="decodes" fills only the one-token sequences' rows, rows="chunks" only the
    others'; together they are the whole batch's output."""
    case = make_case(MIXED, 2, 2, 64, 16, torch.float32, DEVICE, seed=4)
    args = dict(scale=0.125, max_query_len=case.max_query_len, has_decodes=True)
    want = paged_attention_ref(*case.args(), scale=0.125)
    qsl = case.query_start_loc.tolist()
    one = [qsl[i] for i in range(len(qsl) - 1) if qsl[i + 1] - qsl[i] == 1]
    longer = [t for t in range(case.num_tokens) if t not in one]
    out = torch.full_like(case.q, 7.0)
    paged_attention(*case.args(), **args, out=out, rows="decodes")
    torch.testing.assert_close(out[one], want[one], atol=1e-4, rtol=1e-4)
    assert (out[longer] == 7.0).all()
    paged_attention(*case.args(), **args, out=out, rows="chunks")
    n = case.num_tokens
    torch.testing.assert_close(out[:n], want[:n], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="rows"):
        paged_attention(*case.args(), **args, rows="prefills")


@pytest.mark.parametrize("group,splits", [(1, 4), (3, 16), (4, 1)])
def test_short_chunks_in_one_launch_with_kv_split(group, splits):
    """Chunks of up to SHORT_QUERY tokens beside decodes: one launch of decode-shaped
    tiles, each chunk in one tile, the keys split and merged per token (causal within
    the chunk: a split past a token's position is empty for it)."""
    case = make_case(SHORT, 2, group, 64, 16, torch.float32, DEVICE, seed=20 + group)
    cpu = torch.device("cpu")
    config = choose_config(6, 2, group, 64, True, cpu, torch.float32, splits, query_len=5)
    assert config.block_m // group >= SHORT_QUERY and config.num_splits == splits
    _check(case, torch.float32, config=config)


def test_short_chunks_choose_a_kv_split_and_pad_like_a_graph():
    """Few (sequence, KV head) programs: the chosen config splits the keys (the
    interpreter's "GPU" has 8 SMs); padding sequences and rows are left alone; a window
    and a soft-cap hold across the splits."""
    seqs = [(5, 700), (2, 90)]
    case = make_case(seqs, 1, 3, 64, 16, torch.float32, DEVICE, seed=31, pad_seqs=2, pad_tokens=8)
    cfg = choose_config(4, 1, 3, 64, True, case.q.device, torch.float32, query_len=5)
    assert cfg.num_splits > 1
    for kw in ({}, {"sliding_window": 100, "soft_cap": 20.0}):
        out = torch.full_like(case.q, 7.0)
        paged_attention(*case.args(), scale=0.125, max_query_len=5, out=out, **kw)
        assert torch.all(out[case.num_tokens :] == 7.0)
        want = paged_attention_ref(*case.args(), scale=0.125, **kw)
        n = case.num_tokens
        torch.testing.assert_close(out[:n], want[:n], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="short launch"):
        choose_config(4, 1, 3, 64, True, case.q.device, query_len=SHORT_QUERY + 1)
    # A group of 16: a tile of 8 tokens would have 128 rows; such a batch of short
    # chunks takes the two launches of longer ones (decodes keep their 16-row tiles).
    assert short_launch(SHORT_QUERY, 8) and not short_launch(2, 16) and short_launch(1, 16)
    wide = make_case([(1, 90), (3, 50)], 1, 16, 64, 16, torch.float32, DEVICE, seed=32)
    _check(wide, torch.float32)
