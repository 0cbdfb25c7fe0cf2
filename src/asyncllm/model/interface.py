"""What a model class offers the loader and the runners.

The runners size and allocate the KV cache from the model's `KVCacheSpec` rather than
reaching into its layers, so a model is free to arrange its modules as it likes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache a model needs: one cache per attention layer, each holding K
    and V of `num_kv_heads` heads of `head_size` (this rank's heads) per token."""

    num_layers: int
    num_kv_heads: int
    head_size: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of `block_size` tokens takes over all layers, K and V."""
        per_layer = 2 * block_size * self.num_kv_heads * self.head_size * dtype.itemsize
        return per_layer * self.num_layers


class CausalLM(nn.Module, ABC):
    """A decoder over a paged KV cache, built as `cls(hf_config, backend)`."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for N rows of hidden states."""

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Streams checkpoint tensors into parameters; returns the parameters loaded."""

    def expected_parameters(self) -> set[str]:
        """The parameters a checkpoint must provide."""
        return set(dict(self.named_parameters()))
