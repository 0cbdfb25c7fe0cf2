"""Random paged-attention inputs shared by the interpreter and GPU tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionCase:
    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    has_decodes: bool  # some chunk is a single token
    num_tokens: int  # real tokens; q may have padding rows after them

    def args(self):
        return (
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
        )


def make_case(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    pad_seqs: int = 0,
    pad_tokens: int = 0,
    spare_blocks: int = 3,
) -> AttentionCase:
    """seqs: (query length, total length) per sequence. Blocks are handed out in a
    shuffled order; `pad_seqs` empty sequences and `pad_tokens` rows of q that belong to
    no sequence mimic a padded CUDA-graph batch."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for _, n in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need + [1])
    bt = torch.randint(0, num_blocks, (len(seqs) + pad_seqs, width), generator=g)
    used = 0
    for i, nb in enumerate(need):
        bt[i, :nb] = perm[used : used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    qlens = [q for q, _ in seqs] + [0] * pad_seqs
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(qlens).cumsum(0)
    T = int(qsl[-1])
    q = torch.randn(T + pad_tokens, num_kv_heads * group, head_size, generator=g).to(dtype)
    seq_lens = torch.tensor([n for _, n in seqs] + [0] * pad_seqs, dtype=torch.int32)

    def put(t):
        return t.to(device)

    return AttentionCase(
        q=put(q),
        key_cache=put(kc),
        value_cache=put(vc),
        block_table=put(bt.to(torch.int32)),
        seq_lens=put(seq_lens),
        query_start_loc=put(qsl),
        max_query_len=max(qlens + [0]),
        has_decodes=1 in qlens,
        num_tokens=T,
    )
