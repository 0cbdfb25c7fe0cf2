"""What a model class offers the loader and the runners.

The runners size and allocate the KV cache from the model's `KVCacheSpec` rather than
reaching into its layers, so a model is free to arrange its modules as it likes.

Under pipeline parallelism (`model/pipeline.py`) a model holds only its stage's layers:
its `KVCacheSpec` counts those alone, a stage after the first takes the previous
stage's `IntermediateTensors` in `forward`, a stage before the last returns them, and
only the last stage computes logits. At one stage `forward` is what it always was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncllm.model.pipeline import IntermediateTensors, PipelineStage


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache a model needs: one cache per attention layer this rank holds,
    each holding K and V of `num_kv_heads` heads of `head_size` (this rank's heads) per
    token.

    The layers are this rank's pipeline stage's: `num_layers` of them from
    `first_layer` (0 and every layer at one stage), so `kv_caches[i]` in `forward` is
    the cache of the model's layer `first_layer + i`, and `block_bytes` is one stage's.

    A `latent` cache (multi-head latent attention) holds one vector of `head_size`
    values per token and layer instead of K and V (`num_kv_heads` is 1).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    first_layer: int = 0
    latent: bool = False

    @property
    def layers(self) -> range:
        """The model's layers (global indices) the caches belong to, in order."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block of `block_size` tokens takes over all layers, K and V."""
        per_token = (1 if self.latent else 2) * self.num_kv_heads * self.head_size
        per_layer = block_size * per_token * dtype.itemsize
        return per_layer * self.num_layers


class CausalLM(nn.Module, ABC):
    """A decoder over a paged KV cache, built as `cls(hf_config, backend)`.

    Built after the process groups exist: the constructor reads this rank's pipeline
    stage (and tensor-parallel shard) from them and keeps it in `stage`.
    """

    stage: PipelineStage

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [T, hidden] for a flat batch of T tokens, on the last stage.

        `kv_caches` are this stage's (see `KVCacheSpec`). A stage after the first takes
        the previous stage's `intermediate_tensors` (and ignores `input_ids`); a stage
        before the last returns its own for the next stage instead of hidden states.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for N rows of hidden states (the last stage only)."""

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Streams checkpoint tensors into parameters; returns the parameters loaded."""

    def expected_parameters(self) -> set[str]:
        """The parameters a checkpoint must provide (this stage's)."""
        return set(dict(self.named_parameters()))

    def holds_weight(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint tensor is this stage's (the loader reads no other);
        `load_weights` skips the others too."""
        return True

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Uninitialized tensors of the shapes a stage after the first receives for
        `num_tokens` tokens (buffers to receive into, dummy inputs for profiling)."""
        raise NotImplementedError(f"{type(self).__name__} has no pipeline-parallel stages")
