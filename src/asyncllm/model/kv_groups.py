"""KV cache groups: which layers share block tables, read from a Hugging Face config.

Layers of one attention type (full attention, or a sliding window of one size) keep
the same tokens, so they can share a block table. A model mixing types (Gemma 2
alternates local and global layers, Gemma 3 has five local per global one, Qwen2 windows
its layers from `max_window_layers` on) gets one group per type, or several of one type:
every group has the same number of layers (`group_size`), so that one block holds the
same bytes whatever group it serves and all groups draw from one block pool.

The KV cache is `group_size` tensors; the j-th layer of every group uses tensor j, and a
block id is held by one group at a time. A windowed group frees the blocks that fall
wholly out of its window, so a long request holds a few blocks per windowed group and
all of its blocks only in the full-attention groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.config import EngineConfig


def layer_sliding_window(config: Any, layer: int) -> int | None:
    """The sliding window of a decoder layer (None: full attention), as Hugging Face
    reads the config: `sliding_window` on the layers `layer_types` marks
    "sliding_attention"; without `layer_types`, on every layer unless
    `use_sliding_window` is False."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table. `sliding_window` None: full attention."""

    sliding_window: int | None
    layers: tuple[int, ...]  # global layer indices; layers[j] uses KV tensor j

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds in this group between
        steps (one-token decodes)."""
        full = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return full
        return min(full, -(-self.sliding_window // block_size) + 1)


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model's layers (see the module docstring)."""

    groups: tuple[KVCacheGroup, ...]
    group_size: int  # layers per group (the last of a type may have fewer), KV tensors

    @property
    def hybrid(self) -> bool:
        """Whether some group drops the blocks out of its window."""
        return any(g.sliding_window is not None for g in self.groups)

    def tensor_of(self, layer: int) -> tuple[int, int]:
        """(group, KV tensor index) of a global layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds over all groups."""
        return sum(g.max_blocks(num_tokens, block_size) for g in self.groups)


def kv_cache_layout(hf_config: Any, hybrid: bool = True) -> KVCacheLayout:
    """The groups of the model's layers. `hybrid` False: one group of every layer, each
    keeping every token (a windowed layer still attends through its window)."""
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    if not hybrid or n == 0:
        return KVCacheLayout((KVCacheGroup(None, tuple(range(n))),), max(n, 1))
    by_type: dict[int | None, list[int]] = {}
    for layer in range(n):
        by_type.setdefault(layer_sliding_window(hf_config, layer), []).append(layer)
    counts = [len(v) for v in by_type.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:  # near-equal counts: one group per type, a little padding
        size = max(counts)
    groups = []
    # Full attention first, then windows from the smallest: a stable order for the ids.
    for window in sorted(by_type, key=lambda w: -1 if w is None else w):
        layers = by_type[window]
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroup(window, tuple(layers[i : i + size])))
    return KVCacheLayout(tuple(groups), size)


def engine_kv_cache_layout(config: EngineConfig) -> KVCacheLayout:
    """The layout an engine runs with: the scheduler's and every worker's."""
    return kv_cache_layout(config.model.hf_config, config.cache.hybrid_kv_cache)
