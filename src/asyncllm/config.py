"""Engine arguments (what a user passes) and the resolved model configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


def cache_root() -> Path:
    """Where converted models live: $ASYNCLLM_CACHE, default ~/.cache/asyncllm."""
    return Path(os.environ.get("ASYNCLLM_CACHE") or Path.home() / ".cache" / "asyncllm")


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a valid torch device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on a GPU and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of 'auto', {', '.join(map(repr, _DTYPES))}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """A model resolved to a local folder, with its Hugging Face config."""

    model: str | None  # what the user named (None: the embedded default)
    path: Path  # local folder with config.json and weights (or the folder of a GGUF)
    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    load_format: str
    seed: int
    tokenizer: str | None = None

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or ["?"]
        return archs[0]


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine; validated on creation."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    load_format: str = "auto"
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise TypeError(f"model must be a str path or hub id, got {type(self.model).__name__}")
        if self.model is not None:
            self.model = os.fspath(self.model)
            if not self.model.strip():
                raise ValueError("model must not be empty (use None for the embedded default)")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise TypeError(f"tokenizer must be a str, got {type(self.tokenizer).__name__}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
        if (
            not isinstance(self.block_size, int)
            or self.block_size < 1
            or self.block_size & (self.block_size - 1)
        ):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {self.load_format!r} is not one of {LOAD_FORMATS}")
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype {self.dtype!r} is not one of 'auto', {', '.join(map(repr, _DTYPES))}"
            )
        if not isinstance(self.device, str | torch.device):
            raise TypeError(
                f"device must be a str or torch.device, got {type(self.device).__name__}"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_model_config(self) -> ModelConfig:
        from transformers import AutoConfig

        from asyncllm.model.source import resolve_model_path

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        path = resolve_model_path(self.model, revision=self.revision)
        try:
            hf_config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"model folder {str(path)!r} has no usable config.json: {e}") from e
        limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        max_len = self.max_model_len or limit or 2048
        if limit and max_len > limit:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings ({limit})"
            )
        return ModelConfig(
            model=self.model,
            path=path,
            hf_config=hf_config,
            dtype=dtype,
            device=device,
            max_model_len=max_len,
            load_format=self.load_format,
            seed=self.seed,
            tokenizer=self.tokenizer or str(path),
        )
