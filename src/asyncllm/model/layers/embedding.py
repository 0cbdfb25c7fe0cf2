"""Token embedding and LM head, sharded along the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed.parallel_state import get_tp_group
from asyncllm.model.layers.linear import pack_weight, packed_linear, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows.

    Tokens outside a rank's slice embed to zero there; the all-reduce sums the slices.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
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
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; may share its weight with the embedding."""

    packed_weight: torch.Tensor | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def pack_for_cpu(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            logits = packed_linear(hidden_states, self.packed_weight, None)
        else:
            logits = F.linear(hidden_states, self.weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
