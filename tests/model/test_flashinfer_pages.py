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
