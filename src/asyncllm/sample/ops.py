"""Logit transforms, each row with its own parameter, matching the usual definitions
(transformers' logits processors, OpenAI's penalties) exactly."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from asyncllm_kernels.reference import apply_token_bitmask_ref

NEG_INF = float("-inf")


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k largest logits (ties at the k-th value are kept); k=0: all."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab)).long()
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches p."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p).unsqueeze(-1)
    remove[..., -1] = False  # always keep the most likely token
    mask = remove.scatter(-1, idx, remove)
    return logits.masked_fill(mask, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """For tokens seen in the prompt or output: divide positive logits by the penalty,
    multiply negative ones by it. seen: [B, V] bool."""
    pen = penalty.unsqueeze(-1)
    penalized = torch.where(logits < 0, logits * pen, logits / pen)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """logit -= frequency * count + presence * [count > 0], over generated tokens."""
    return logits - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * (counts > 0)


def block_tokens_(row: torch.Tensor, ids: list[int]) -> None:
    """Masks `ids` in one row of logits (min_tokens: EOS and the stop tokens), in place,
    unless every other token is masked already (a grammar at its end allows only its
    end tokens): the row keeps them then, rather than draw a token at random. No sync:
    the choice is made on the device."""
    index = torch.tensor(ids, dtype=torch.int64).to(row.device, non_blocking=True)
    kept = row.index_select(0, index)
    row.index_fill_(0, index, NEG_INF)
    nothing_else = torch.isneginf(row).all()
    row.index_copy_(0, index, torch.where(nothing_else, kept, NEG_INF))


def bincount_rows(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts of each row's tokens."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    lens = [len(t) for t in token_lists]
    if sum(lens):
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lens))
        cols = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
        counts.index_put_(
            (rows.to(device), cols.to(device)),
            torch.ones(len(cols), device=device),
            accumulate=True,
        )
    return counts


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Masks, in place, the tokens row `rows[i]` of `logits` may not take: `bitmask[i]`
    packs one bit per token (int32 words, token t is bit t % 32 of word t // 32; set:
    allowed). Tokens past the bitmask's width are masked. On CUDA one Triton launch;
    elsewhere `apply_token_bitmask_cpu`."""
    if logits.device.type == "cuda":
        from asyncllm_kernels.bitmask import apply_token_bitmask_

        apply_token_bitmask_(logits, rows, bitmask)
    else:
        apply_token_bitmask_cpu(logits, rows, bitmask)


_BYTE_LIMITS: dict[torch.dtype, torch.Tensor] = {}


def _byte_limits(dtype: torch.dtype) -> torch.Tensor:
    """[256, 8] in `dtype`: for each byte value, +inf at its set bits and -inf at its
    clear ones (bit k of the byte: column k)."""
    table = _BYTE_LIMITS.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
        bits = (codes >> torch.arange(8, dtype=torch.int32)) & 1
        table = torch.where(bits.bool(), float("inf"), NEG_INF).to(dtype)
        _BYTE_LIMITS[dtype] = table
    return table


def apply_token_bitmask_cpu(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> None:
    """`apply_token_bitmask` off CUDA, 4-8x faster than unpacking the bits with shifts
    (`apply_token_bitmask_ref`): each byte of the bitmask looks up the limits of its 8
    tokens (+inf: allowed, -inf: not, `_byte_limits`), and each logit is clamped to at
    most its limit (a NaN logit stays NaN: a token it makes the sampler choose against
    its grammar is refused by the matcher, and ends its request with that error). Rows
    that are one ascending run of `logits` are masked where they lie."""
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    n, words = bitmask.shape
    if rows.shape != (n,):
        raise ValueError(f"rows has shape {tuple(rows.shape)}, the bitmask {n} rows")
    if n == 0:
        return
    if sys.byteorder != "little":  # (the lookup reads each word's bytes lowest first)
        apply_token_bitmask_ref(logits, rows, bitmask)
        return
    vocab = logits.shape[-1]
    width = min(vocab, 32 * words)
    codes = bitmask.contiguous().view(torch.uint8).long()
    limits = F.embedding(codes, _byte_limits(logits.dtype)).view(n, 32 * words)[:, :width]
    first = int(rows[0])
    in_place = first >= 0 and torch.equal(rows, torch.arange(first, first + n, dtype=rows.dtype))
    target = logits[first : first + n] if in_place else logits[rows]
    target[:, :width].clamp_max_(limits)
    if width < vocab:
        target[:, width:] = NEG_INF
    if not in_place:
        logits[rows] = target
