"""Builds a model on its target device and streams checkpoint weights into it.

Formats: safetensors (single, or sharded with `model.safetensors.index.json`;
memory-mapped), PyTorch `.bin` files as a fallback, and "dummy" (uniform weights in
±1e-3, for benchmarks). GGUF files and hub ids are turned into local folders by
`asyncllm.model.source` before they get here. A pipeline stage reads only its own
tensors (`CausalLM.holds_weight`).
"""

from __future__ import annotations

import contextlib
import glob
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from asyncllm import envs
from asyncllm.config import ModelConfig
from asyncllm.model.attention.backend import AttentionBackend
from asyncllm.model.interface import CausalLM
from asyncllm.model.layers.linear import cpu_packing_available
from asyncllm.model.progress import progress
from asyncllm.model.registry import resolve_model_class

DUMMY_WEIGHT_RANGE = 1e-3


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {missing}")
        return files
    return sorted(Path(p) for p in glob.glob(str(folder / "*.safetensors")))


def bin_files(folder: Path) -> list[Path]:
    return sorted(
        Path(p) for p in glob.glob(str(folder / "*.bin")) if not p.endswith("training_args.bin")
    )


# Which checkpoint tensors to read, by name (None: all of them).
WeightFilter = Callable[[str], bool] | None


def iter_safetensors(
    files: list[Path], device: torch.device, keep: WeightFilter = None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    # safe_open memory-maps the file; on CUDA tensors are read straight to the device.
    target = "cpu" if device.type == "cpu" else str(device)
    for f in files:
        with safe_open(str(f), framework="pt", device=target) as st:
            names = list(st.keys())  # (safe_open is not a dict)
            if keep is not None:
                names = [name for name in names if keep(name)]
            for name in progress(names, f"loading {f.name}"):
                yield name, st.get_tensor(name)


def iter_bin(files: list[Path], keep: WeightFilter = None) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in state.items():
            if keep is None or keep(name):
                yield name, tensor
        del state


class DefaultModelLoader:
    def __init__(self, load_format: str = "auto") -> None:
        self.load_format = load_format

    def weights(
        self, folder: Path, device: torch.device, keep: WeightFilter = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors by name; with `keep`, only those it accepts are read."""
        fmt = self.load_format
        if fmt in ("auto", "safetensors", "gguf"):
            files = safetensors_files(folder)
            if files:
                return iter_safetensors(files, device, keep)
            if fmt == "safetensors":
                raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
        if fmt in ("auto", "pt"):
            files = bin_files(folder)
            if files:
                return iter_bin(files, keep)
        raise FileNotFoundError(
            f"no weights in {str(folder)!r} (looked for *.safetensors and *.bin)"
        )

    def load_model(self, model_config: ModelConfig, backend: AttentionBackend) -> CausalLM:
        cls = resolve_model_class(model_config.hf_config)
        device, dtype = model_config.device, model_config.dtype
        with torch.device(device), _default_dtype(dtype):
            model = cls(model_config.hf_config, backend)
        model.to(device)  # buffers built on the CPU (rotary tables)
        if self.load_format == "dummy":
            gen = torch.Generator(device=device).manual_seed(model_config.seed)
            for p in model.parameters():
                p.data.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen)
        else:
            weights = self.weights(model_config.path, device, model.holds_weight)
            loaded = model.load_weights(weights)
            missing = model.expected_parameters() - loaded
            if missing:
                raise ValueError(
                    f"checkpoint in {str(model_config.path)!r} lacks weights: {', '.join(sorted(missing)[:8])}"
                    + (" …" if len(missing) > 8 else "")
                )
        if use_folded_norms(device, dtype):
            for module in model.modules():
                fold = getattr(module, "fold_norms", None)
                if fold is not None:
                    fold()
        if use_cpu_packing(device, dtype):
            for module in model.modules():
                pack = getattr(module, "pack_for_cpu", None)
                if pack is not None:
                    pack()
        return model.eval()


def use_folded_norms(device: torch.device, dtype: torch.dtype) -> bool:
    """The norms' weights folded into the linear layers after them, for the fused
    small-batch GEMMs (ASYNCLLM_FUSED_GEMM=1; 16-bit on CUDA)."""
    return envs.fused_gemm() and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def use_cpu_packing(device: torch.device, dtype: torch.dtype) -> bool:
    """Prepacked oneDNN weights for float32 on the CPU (ASYNCLLM_CPU_PACKING=0 turns it off)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    if not envs.cpu_packing_enabled():
        return False
    return cpu_packing_available()


def load_model(model_config: ModelConfig, backend: AttentionBackend) -> CausalLM:
    return DefaultModelLoader(model_config.load_format).load_model(model_config, backend)


__all__ = ["DefaultModelLoader", "load_model"]
