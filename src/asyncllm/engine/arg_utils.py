"""EngineArgs -> EngineConfig: the step that reaches into the model and sampler layers
(resolving the model folder, reading its Hugging Face config, importing logits
processors), kept out of the leaf `config` module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncllm.config import (
    CPU_BATCH_DEFAULTS,
    CUDA_BATCH_DEFAULTS,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    HFConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    default_capture_sizes,
)
from asyncllm.model.source import resolve_model_path
from asyncllm.sample.logits_processor import load_logits_processor_class

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a valid torch device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)  # the first visible GPU (CUDA_VISIBLE_DEVICES picks it)
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


def read_hf_config(path: Path) -> HFConfig:
    """The model folder's config.json as transformers reads it."""
    from transformers import AutoConfig  # imported when needed: it takes seconds

    try:
        return HFConfig(AutoConfig.from_pretrained(str(path)).to_dict())
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder {str(path)!r} has no usable config.json: {e}") from e


def create_model_config(args: EngineArgs, hf_fields: dict[str, Any] | None = None) -> ModelConfig:
    """Resolves the model to a local folder (converting a GGUF once) and reads its config
    (or takes its fields as the host read them: `hf_fields`)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_model_path(args.model, revision=args.revision)
    hf_config = read_hf_config(path) if hf_fields is None else HFConfig(hf_fields)
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    max_len = args.max_model_len or limit or 2048
    if limit and max_len > limit:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings ({limit})"
        )
    return ModelConfig(
        model=args.model,
        path=path,
        hf_config=hf_config,
        dtype=dtype,
        device=device,
        max_model_len=max_len,
        load_format=args.load_format,
        seed=args.seed,
        tokenizer=args.tokenizer or str(path),
    )


def create_engine_config(args: EngineArgs, hf_fields: dict[str, Any] | None = None) -> EngineConfig:
    """Everything the engine needs, checked: the model resolved, the logits processors
    importable, the scheduler and cache settings filled in. `hf_fields`: the model's
    config as the host read it (the engine core's process gets it so)."""
    for path in args.logits_processors or []:
        load_logits_processor_class(path)  # fail here, with the path named
    model = create_model_config(args, hf_fields)
    if args.attention_backend == "triton" and model.device.type != "cuda":
        raise ValueError(f"attention_backend 'triton' needs a CUDA device, got {model.device}")
    seqs_default, batched_default = (
        CUDA_BATCH_DEFAULTS if model.device.type == "cuda" else CPU_BATCH_DEFAULTS
    )
    max_num_seqs = args.max_num_seqs or seqs_default
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = batched_default
        if not args.enable_chunked_prefill:
            batched = max(batched, model.max_model_len)
    elif not args.enable_chunked_prefill and batched < model.max_model_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({batched}) must be at least "
            f"max_model_len ({model.max_model_len})"
        )
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=model.max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        # a cap on prefill chunks: meaningless (and a stall) when prompts cannot be chunked
        long_prefill_token_threshold=(
            args.long_prefill_token_threshold if args.enable_chunked_prefill else 0
        ),
        policy=SchedulingPolicy(args.scheduling_policy),
        max_waiting_requests=args.max_waiting_requests,
        async_scheduling=args.async_scheduling,
    )
    cache = CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=float(args.gpu_memory_utilization),
    )
    parallel = ParallelConfig(
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        args.distributed_executor_backend,
    )
    return EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        parallel=parallel,
        logits_processors=list(args.logits_processors or []),
        skip_tokenizer_init=args.skip_tokenizer_init,
        enforce_eager=args.enforce_eager,
        max_logprobs=args.max_logprobs,
        attention_backend=args.attention_backend,
        cudagraph_capture_sizes=_capture_sizes(args, model.device, max_num_seqs),
        cpu_threads=args.cpu_threads,
    )


def _capture_sizes(args: EngineArgs, device: torch.device, max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: none on the CPU or with enforce_eager; the given
    ones (at most max_num_seqs) or the default ladder otherwise."""
    if device.type != "cuda" or args.enforce_eager:
        return []
    if args.cudagraph_capture_sizes is None:
        return default_capture_sizes(max_num_seqs)
    if max(args.cudagraph_capture_sizes, default=0) > max_num_seqs:
        raise ValueError(
            f"cudagraph_capture_sizes {args.cudagraph_capture_sizes} has a size above "
            f"max_num_seqs ({max_num_seqs})"
        )
    return list(args.cudagraph_capture_sizes)
