"""Logit transforms, each row with its own parameter, matching the usual definitions
(transformers' logits processors, OpenAI's penalties) exactly."""

from __future__ import annotations

import torch

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
    elsewhere the plain-torch reference."""
    if logits.device.type == "cuda":
        from asyncllm_kernels.bitmask import apply_token_bitmask_

        apply_token_bitmask_(logits, rows, bitmask)
    else:
        apply_token_bitmask_ref(logits, rows, bitmask)
