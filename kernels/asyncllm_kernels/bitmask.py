"""Grammar masks on the logits: one launch masks every constrained row.

`apply_token_bitmask_(logits, rows, bitmask)` sets to -inf, in place, each token that
row `rows[i]` of `logits` may not take: bit t % 32 of word t // 32 of `bitmask[i]`
clear (tokens past the bitmask's width are masked too). Its plain-torch reference is
`reference.apply_token_bitmask_ref`. The grid depends only on the shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per program: 32 words of the bitmask


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    rows_ptr,
    bitmask_ptr,
    stride_logits,
    vocab,
    words,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    in_vocab = offs < vocab
    word_index = offs // 32
    word = tl.load(
        bitmask_ptr + i.to(tl.int64) * words + word_index,
        mask=in_vocab & (word_index < words),
        other=0,
    )
    allowed = ((word >> (offs % 32)) & 1) != 0
    ninf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, ninf, mask=in_vocab & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [R, V] (unit stride in V); rows: [N] int, rows of `logits`; bitmask:
    [N, W] int32, all on one device."""
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.stride(-1) != 1 or not bitmask.is_contiguous():
        raise ValueError("logits need a unit stride in the vocabulary; bitmask contiguous")
    n, words = bitmask.shape
    if rows.shape != (n,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, the bitmask {n} rows")
    vocab = logits.shape[-1]
    if n == 0:
        return
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, rows, bitmask, logits.stride(0), vocab, words, BLOCK=BLOCK
    )
