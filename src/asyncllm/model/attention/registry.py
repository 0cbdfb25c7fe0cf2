"""The attention backends, and the choice of one for an engine.

Each backend is one module with an `AttentionBackend` subclass, and one entry here
(`AttentionBackendEntry`) that declares what it supports: devices, dtypes, head sizes,
block sizes, its KV cache layout, features, and how far its step can live inside a CUDA
graph. An entry names its class by module path, so nothing a backend imports (Triton,
for one) is imported until it is chosen.

`attention_backend=None` or `"auto"` takes the first entry, in registration order, that
supports the device, the dtype, the model's head size, the block size and the features
the model needs; a backend named explicitly must support them too, or start-up fails
saying why.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncllm.model.attention.backend import AttentionBackend
from asyncllm.model.kv_groups import layer_sliding_window

logger = logging.getLogger(__name__)

AUTO = "auto"


class AttentionCGSupport(enum.Enum):
    """How much of a step a backend's attention can run inside a CUDA graph (vLLM's
    names): every batch; batches whose requests all have one query length; only batches
    of one-token decodes (the decode graphs the model runner captures); none."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class AttentionFeature(enum.Enum):
    SLIDING_WINDOW = "sliding window"
    LOGITS_SOFT_CAP = "logit soft-cap"
    LATENT_ATTENTION = "latent attention (MLA)"


class KVCacheLayout(enum.Enum):
    """A layer's KV cache tensor: K and V stacked first, then the paged blocks, each
    block's tokens, heads and head dims (what `AttentionBackend.kv_cache_shape` gives)."""

    KV_BLOCKS_TOKENS_HEADS = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    # Latent attention (MLA): one vector per token, the latent then the rotary key.
    LATENT_BLOCKS_TOKENS = "(num_blocks, block_size, head_size)"

    def shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        if self is KVCacheLayout.LATENT_BLOCKS_TOKENS:
            return (num_blocks, block_size, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)


@dataclass(frozen=True)
class AttentionNeeds:
    """What an engine asks of its attention backend."""

    device: torch.device
    dtype: torch.dtype | None = None  # None: not checked
    head_size: int | None = None
    block_size: int | None = None
    features: frozenset[AttentionFeature] = frozenset()

    @classmethod
    def of_model(
        cls, hf_config: Any, device: torch.device, dtype: torch.dtype, block_size: int
    ) -> AttentionNeeds:
        """From a Hugging Face config: its head size (a latent-attention model's: the
        cached vector, latent and rotary key) and the features its layers use."""
        heads = hf_config.num_attention_heads
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        latent = getattr(hf_config, "kv_lora_rank", None)
        if latent is not None:
            head_size = int(latent) + int(hf_config.qk_rope_head_dim)
        features = set()
        if _uses_sliding_window(hf_config):
            features.add(AttentionFeature.SLIDING_WINDOW)
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            features.add(AttentionFeature.LOGITS_SOFT_CAP)
        if getattr(hf_config, "kv_lora_rank", None) is not None:
            features.add(AttentionFeature.LATENT_ATTENTION)
        return cls(device, dtype, int(head_size), block_size, frozenset(features))


def _uses_sliding_window(hf_config: Any) -> bool:
    """Whether some layer attends through a sliding window (as the models read it)."""
    layers = range(int(getattr(hf_config, "num_hidden_layers", 0) or 0))
    return any(layer_sliding_window(hf_config, i) is not None for i in layers)


def library_installed(module: str) -> bool:
    """Whether `module` can be imported (a dotted name whose parent is missing: no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@dataclass(frozen=True)
class AttentionBackendEntry:
    """One backend's declaration: `class_path` ("package.module:Class") is imported only
    when the backend is chosen. None for device types, dtypes, head sizes or block
    sizes: any."""

    name: str
    class_path: str
    device_types: frozenset[str] | None
    dtypes: frozenset[torch.dtype] | None = None
    head_sizes: frozenset[int] | None = None
    block_sizes: frozenset[int] | None = None
    kv_cache_layout: KVCacheLayout = KVCacheLayout.KV_BLOCKS_TOKENS_HEADS
    features: frozenset[AttentionFeature] = field(default_factory=frozenset)
    cudagraph_support: AttentionCGSupport = AttentionCGSupport.NEVER
    # An optional library it runs on: (module to import, the package extra that installs it).
    requires: tuple[str, str] | None = None

    def installed(self) -> bool:
        return self.requires is None or library_installed(self.requires[0])

    @property
    def latent_only(self) -> bool:
        """An MLA backend serves latent-attention layers and no others."""
        return self.kv_cache_layout is KVCacheLayout.LATENT_BLOCKS_TOKENS

    def unsupported(self, needs: AttentionNeeds) -> str | None:
        """Why this backend cannot serve `needs`, or None if it can."""
        if self.latent_only and AttentionFeature.LATENT_ATTENTION not in needs.features:
            return "serves only latent-attention (MLA) models"
        if not self.installed():
            assert self.requires is not None
            return (
                f"needs {self.requires[0]}, which is not installed "
                f"(pip install 'asyncllm[{self.requires[1]}]')"
            )
        if self.device_types is not None and needs.device.type not in self.device_types:
            wanted = " or ".join(sorted(t.upper() for t in self.device_types))
            return f"needs a {wanted} device, got {needs.device}"
        checks = (
            ("dtype", needs.dtype, self.dtypes),
            ("head size", needs.head_size, self.head_sizes),
            ("block size", needs.block_size, self.block_sizes),
        )
        for what, value, allowed in checks:
            if value is not None and allowed is not None and value not in allowed:
                return f"does not support {what} {value} (it supports {sorted(map(str, allowed))})"
        missing = needs.features - self.features
        if missing:
            return "does not support " + ", ".join(sorted(f.value for f in missing))
        return None

    def load(self) -> AttentionBackend:
        """An instance of the backend (imports its module)."""
        module, _, cls_name = self.class_path.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        shape = cls.kv_cache_shape(3, 5, 7, 11)
        if shape != self.kv_cache_layout.shape(3, 5, 7, 11):
            raise TypeError(
                f"attention backend {self.name!r}: {cls.__name__}.kv_cache_shape gives "
                f"{shape}, not its declared layout {self.kv_cache_layout.value}"
            )
        backend: AttentionBackend = cls()
        return backend


_BACKENDS: dict[str, AttentionBackendEntry] = {}


def register_attention_backend(entry: AttentionBackendEntry) -> None:
    """Adds a backend, after those registered before it (for "auto", earlier wins)."""
    if entry.name == AUTO or entry.name in _BACKENDS:
        raise ValueError(f"attention backend {entry.name!r} is registered already")
    _BACKENDS[entry.name] = entry


def unregister_attention_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def attention_backend_names() -> list[str]:
    """The registered names, in the order "auto" tries them."""
    return list(_BACKENDS)


def find_attention_backend(name: str | None, needs: AttentionNeeds) -> AttentionBackendEntry:
    """The entry named (None or "auto": the first that serves `needs`); a ValueError
    naming the field if there is no such backend or it cannot serve `needs`."""
    if name is None or name == AUTO:
        return _first_fit(needs)
    entry = _BACKENDS.get(name)
    if entry is None:
        names = ", ".join(repr(n) for n in [AUTO, *_BACKENDS])
        raise ValueError(f"attention_backend must be one of {names}, got {name!r}")
    why = entry.unsupported(needs)
    if why is not None:
        raise ValueError(f"attention_backend {name!r} {why}")
    return entry


def _first_fit(needs: AttentionNeeds) -> AttentionBackendEntry:
    reasons = []
    for entry in _BACKENDS.values():
        why = entry.unsupported(needs)
        if why is None:
            return entry
        reasons.append(f"{entry.name} {why}")
    raise ValueError(f"attention_backend 'auto': no backend fits ({'; '.join(reasons)})")


def choose_attention_backend(
    name: str | None, needs: AttentionNeeds
) -> tuple[AttentionBackendEntry, AttentionBackend]:
    """The backend to run, its entry and an instance; the choice is logged."""
    entry = find_attention_backend(name, needs)
    how = "chosen by 'auto'" if name is None or name == AUTO else "as asked"
    logger.info(
        "attention backend: %s (%s, for %s, %s, head size %s)",
        entry.name,
        how,
        needs.device,
        needs.dtype,
        needs.head_size,
    )
    return entry, entry.load()


def select_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """A backend for `device` (only the device is checked: model tests, benchmarks)."""
    return choose_attention_backend(name, AttentionNeeds(device))[1]


_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
_ALL_FEATURES_BUT_LATENT = frozenset(
    {AttentionFeature.SLIDING_WINDOW, AttentionFeature.LOGITS_SOFT_CAP}
)

# The built-in backends, in the order "auto" tries them: the Triton kernels on CUDA,
# plain torch anywhere (the reference); each with its latent-attention (MLA) twin, which
# serves MLA models only.
register_attention_backend(
    AttentionBackendEntry(
        name="triton",
        class_path="asyncllm.model.attention.triton_attn:TritonAttentionBackend",
        device_types=frozenset({"cuda"}),
        dtypes=_FLOATS,
        features=_ALL_FEATURES_BUT_LATENT,
        # (a batch of one query length captures one launch whose grid and tiles depend
        # only on its padded shape: decodes, and steps verifying drafts, whose chunks of
        # at most that length it also serves; a mixed step's launches depend on host
        # values, so mixed steps run eager)
        cudagraph_support=AttentionCGSupport.UNIFORM_BATCH,
    )
)
register_attention_backend(
    AttentionBackendEntry(
        name="triton_mla",
        class_path="asyncllm.model.attention.triton_mla:TritonMLABackend",
        device_types=frozenset({"cuda"}),
        dtypes=_FLOATS,
        kv_cache_layout=KVCacheLayout.LATENT_BLOCKS_TOKENS,
        features=frozenset({AttentionFeature.LATENT_ATTENTION}),
        # (decodes run the graph-safe kernel; prefill chunks loop over sequences)
        cudagraph_support=AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
    )
)


def _library_backend(
    name: str, class_path: str, graphs: AttentionCGSupport, requires: tuple[str, str]
) -> AttentionBackendEntry:
    """A backend of an optional library's CUDA kernels: 16-bit, head sizes 64/128/256,
    windows and soft-caps."""
    return AttentionBackendEntry(
        name=name,
        class_path=class_path,
        device_types=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_sizes=frozenset({64, 128, 256}),
        features=_ALL_FEATURES_BUT_LATENT,
        cudagraph_support=graphs,
        requires=requires,
    )


# (decode graphs have wrappers over fixed buffers, planned before each replay)
register_attention_backend(
    _library_backend(
        "flashinfer",
        "asyncllm.model.attention.flashinfer:FlashInferBackend",
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        ("flashinfer", "flashinfer"),
    )
)
# (decodes and their graphs are the Triton kernel's: nothing planned per replay)
register_attention_backend(
    _library_backend(
        "flashinfer_prefill",
        "asyncllm.model.attention.flashinfer_prefill:FlashInferPrefillBackend",
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        ("flashinfer", "flashinfer"),
    )
)
# (not captured yet: its first calls compile, and graphs are unmeasured with it)
register_attention_backend(
    _library_backend(
        "flash_attn",
        "asyncllm.model.attention.flash_attn:FlashAttentionBackend",
        AttentionCGSupport.NEVER,
        ("flash_attn.cute", "flash-attn"),
    )
)
register_attention_backend(
    AttentionBackendEntry(
        name="torch_native",
        class_path="asyncllm.model.attention.torch_native:TorchNativeBackend",
        device_types=None,
        features=_ALL_FEATURES_BUT_LATENT,
        # (its metadata builder sizes tensors from device values: no graph capture)
        cudagraph_support=AttentionCGSupport.NEVER,
    )
)
register_attention_backend(
    AttentionBackendEntry(
        name="torch_mla",
        class_path="asyncllm.model.attention.mla:MLABackend",
        device_types=None,
        kv_cache_layout=KVCacheLayout.LATENT_BLOCKS_TOKENS,
        features=frozenset({AttentionFeature.LATENT_ATTENTION}),
        cudagraph_support=AttentionCGSupport.NEVER,
    )
)
