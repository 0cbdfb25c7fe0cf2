"""The FlashInfer backend's page tables, built on the host (no GPU or FlashInfer needed):
each sequence's pages are its block-table row's first ceil(len / block size) entries,
its last page holds the rest, and a sequence with no keys (a graph's padding row) reads
one key of its row's first block (the runner's padding rows point at block 0)."""

from __future__ import annotations

import numpy as np

from asyncllm.model.attention.backend import CommonAttentionMetadata
from asyncllm.model.attention.flashinfer import PagedBatch


def test_pages_follow_the_block_table():
    rng = np.random.default_rng(0)
    bs, width = 16, 12
    seq_lens = np.array([1, 16, 17, 150, 0, 0], dtype=np.int32)
    query_lens = np.array([1, 16, 5, 1, 0, 0])
    table = rng.permutation(100)[: 6 * width].reshape(6, width).astype(np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    common = CommonAttentionMetadata.from_numpy(
        qsl, seq_lens, table, np.full(int(qsl[-1]), -1, dtype=np.int64), "cpu"
    )
    b = PagedBatch.of(common, bs)
    assert b.qo_indptr.tolist() == qsl.tolist()
    pages = [1, 1, 2, 10, 1, 1]
    assert b.kv_indptr.tolist() == np.concatenate([[0], np.cumsum(pages)]).tolist()
    want = np.concatenate([table[i, :n] for i, n in enumerate(pages)])
    assert b.kv_indices.tolist() == want.tolist()
    assert b.last_page_len.tolist() == [1, 16, 1, 150 - 9 * 16, 1, 1]
    assert b.kv_indices.dtype == b.kv_indptr.dtype == b.last_page_len.dtype


def test_the_chunks_of_a_mixed_batch_and_their_pages():
    """flashinfer_prefill's split: the sequences longer than one token, their rows in the
    batch, and their pages as a batch of their own (query offsets from 0)."""
    from asyncllm.model.attention.flashinfer_prefill import chunk_tokens

    qsl = np.array([0, 1, 6, 7, 10, 11], dtype=np.int32)  # 1, 5, 1, 3, 1 tokens
    seqs, rows = chunk_tokens(qsl)
    assert seqs.tolist() == [1, 3] and rows.tolist() == [1, 2, 3, 4, 5, 7, 8, 9]
    assert chunk_tokens(np.array([0, 1, 2]))[1].tolist() == []
    seq_lens = np.array([9, 20, 4, 35, 2], dtype=np.int32)
    table = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    lens = np.diff(qsl)[seqs]
    b = PagedBatch.from_arrays(
        np.concatenate([[0], np.cumsum(lens)]), seq_lens[seqs], table[seqs], 16
    )
    assert b.qo_indptr.tolist() == [0, 5, 8]
    assert b.kv_indptr.tolist() == [0, 2, 5] and b.kv_indices.tolist() == [3, 4, 9, 10, 11]
    assert b.last_page_len.tolist() == [4, 3]
