"""Token embedding and LM head, sharded along the vocabulary.

At tensor-parallel size above 1 the vocabulary is padded to a multiple of 64 per rank
(64 x TP in all) and each rank holds one contiguous slice of the padded rows; the rows
past the vocabulary are zeros. The embedding sums the ranks' lookups (a token is found
on one rank, zeros elsewhere); the LM head gathers every rank's logits and drops the
padding. At size 1 nothing is padded: the weight has the checkpoint's shape and the
logits are the LM head's own output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed.parallel_state import get_tp_group
from asyncllm.model.layers.linear import pack_weight, packed_linear, set_weight_attrs

VOCAB_PADDING = 64


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary the shards cover: unchanged at TP 1, else rounded up to a
    multiple of VOCAB_PADDING x TP, so every rank holds the same number of rows, a
    multiple of 64."""
    if tp_size == 1:
        return vocab_size
    step = VOCAB_PADDING * tp_size
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the (padded) vocabulary's rows.

    Tokens outside a rank's slice embed to zero there; the all-reduce sums the slices.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, self.tp.world_size)
        self.shard_size = self.num_embeddings_padded // self.tp.world_size
        self.vocab_start = self.tp.rank_in_group * self.shard_size
        # A rank whose slice is all padding holds no token: an empty range.
        self.vocab_end = max(
            self.vocab_start, min(self.vocab_start + self.shard_size, num_embeddings)
        )
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        name = getattr(param, "checkpoint_name", "?")
        expected = (self.num_embeddings, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"weight {name!r} has shape {tuple(loaded.shape)}, expected {expected}"
            )
        rows = self.vocab_end - self.vocab_start
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the vocabulary; may share its weight with
    the embedding (the same shard on each rank)."""

    packed_weight: torch.Tensor | None = None
    tied: bool = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie an LM head of shape {tuple(self.weight.shape)} to an embedding "
                f"of shape {tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight
        self.tied = True

    def pack_for_cpu(self) -> None:
        """Computes with a packed copy from then on; an untied head gives up its
        parameter's storage (a tied one is the embedding's table, still looked up)."""
        self.packed_weight = pack_weight(self.weight)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty((0,))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            logits = packed_linear(hidden_states, self.packed_weight, None)
        else:
            logits = F.linear(hidden_states, self.weight)
        if self.tp.world_size == 1:
            return logits
        return self._gather(logits)

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits side by side, the padding left out: one copy."""
        world, shard = self.tp.world_size, self.shard_size
        parts = self.tp.all_gather(logits, 0).view(world, *logits.shape).unbind(0)
        widths = [min(shard, max(0, self.num_embeddings - r * shard)) for r in range(world)]
        return torch.cat([p[..., :w] for p, w in zip(parts, widths) if w], dim=-1)
