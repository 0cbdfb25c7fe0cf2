"""EngineArgs -> EngineConfig, on the engine core's side: the step that reaches into the
model and sampler layers (resolving the model folder, converting a GGUF once, reading its
Hugging Face config, picking the device and dtype, importing logits processors), kept out
of the leaf `config` module. The host gets the result as a `ResolvedConfig`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

import msgspec
import torch

from asyncllm import envs
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
    SpeculativeConfig,
    default_capture_sizes,
    num_experts,
)
from asyncllm.envs import cache_root
from asyncllm.messages import ResolvedConfig
from asyncllm.model.attention.registry import AttentionNeeds, find_attention_backend
from asyncllm.model.layers.linear import shard_attention_heads
from asyncllm.model.pipeline import stage_partition
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
    """The model folder's config.json as transformers reads it (every field, its defaults
    filled in: `PretrainedConfig.to_dict()`). transformers' reading is kept in the cache
    (`configs/`), keyed by the file's bytes and transformers' version, so that later
    starts read it back without importing transformers (about 2 s of the core's start
    on the 2-core machine)."""
    cached = _normalised_config_path(path)
    if cached is not None and cached.is_file():
        try:
            return HFConfig(msgspec.msgpack.decode(cached.read_bytes()))
        except (OSError, msgspec.DecodeError):
            pass  # (unreadable: read it again below, and rewrite it)
    from transformers import AutoConfig  # imported when needed: it takes seconds

    try:
        fields = AutoConfig.from_pretrained(str(path)).to_dict()
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder {str(path)!r} has no usable config.json: {e}") from e
    if cached is not None:
        _keep(cached, fields)
    return HFConfig(fields)


def _normalised_config_path(path: Path) -> Path | None:
    """Where transformers' reading of `path`'s config.json is kept; None when the file
    cannot be read (transformers then says why)."""
    try:
        raw = (path / "config.json").read_bytes()
        version = importlib.metadata.version("transformers")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    key = hashlib.sha256(version.encode() + b"\0" + raw).hexdigest()[:32]
    return cache_root() / "configs" / f"{key}.msgpack"


def _keep(target: Path, fields: dict[str, Any]) -> None:
    """Writes the fields atomically if msgpack holds them exactly (else nothing is
    kept)."""
    try:
        data = msgspec.msgpack.encode(fields)
        if msgspec.msgpack.decode(data) != fields:
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except (OSError, TypeError, ValueError, msgspec.EncodeError):
        pass  # (a cache: the next start reads config.json again)


# Multimodal checkpoints whose text model runs alone: architecture -> the field of its
# config that holds the text model's (the model class skips the other weights).
TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "text_config"}


def text_model_config(hf_config: HFConfig) -> HFConfig:
    """The config the engine runs: a multimodal checkpoint's text model's (keeping the
    checkpoint's architecture, and the token ids only the outer config sets), else the
    config itself."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    key = next((TEXT_MODEL_OF[a] for a in archs if a in TEXT_MODEL_OF), None)
    if key is None:
        return hf_config
    outer = hf_config.to_dict()
    fields = dict(outer.get(key) or {})
    if not fields:
        raise ValueError(f"{archs[0]} config has no {key!r}")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if fields.get(name) is None and outer.get(name) is not None:
            fields[name] = outer[name]
    fields["architectures"] = archs
    return HFConfig(fields)


def create_model_config(args: EngineArgs) -> ModelConfig:
    """Resolves the model to a local folder (converting a GGUF once) and reads its
    config (a multimodal checkpoint's text model's: `text_model_config`)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_model_path(args.model, revision=args.revision)
    hf_config = text_model_config(read_hf_config(path))
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


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Everything the engine needs, checked: the model resolved, the logits processors
    importable, the scheduler and cache settings filled in."""
    for path in args.logits_processors or []:
        load_logits_processor_class(path)  # fail here, with the path named
    model = create_model_config(args)
    needs = AttentionNeeds.of_model(model.hf_config, model.device, model.dtype, args.block_size)
    find_attention_backend(args.attention_backend, needs)  # unknown, or cannot serve the model
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
        runner_holds_samples=args.pipeline_parallel_size == 1,
        speculative=speculative_config(args, model),
    )
    cache = CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=float(args.gpu_memory_utilization),
        hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager,
    )
    parallel = ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size)
    parallel.distributed_executor_backend = args.distributed_executor_backend or default_backend(
        parallel.world_size, model.device
    )
    check_parallel(parallel, model)
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
        ubatch=args.ubatch,
        cpu_threads=args.cpu_threads,
    )


def speculative_config(args: EngineArgs, model: ModelConfig) -> SpeculativeConfig | None:
    """EngineArgs.speculative_config (checked already) for the scheduler; a ValueError
    where it cannot run yet: pipeline parallelism (a stage does not hold the tokens it
    would draft from), latent-attention models (untested)."""
    spec = args.speculative_config
    if spec is None:
        return None
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            f"speculative_config is not supported with pipeline_parallel_size="
            f"{args.pipeline_parallel_size} yet"
        )
    if getattr(model.hf_config, "kv_lora_rank", None) is not None:
        raise ValueError(
            f"speculative_config: {model.architecture} uses latent attention (MLA), "
            "not supported with speculative decoding yet"
        )
    return SpeculativeConfig(
        num_speculative_tokens=spec["num_speculative_tokens"],
        prompt_lookup_min=spec["prompt_lookup_min"],
        prompt_lookup_max=spec["prompt_lookup_max"],
        disable_by_batch_size=spec["disable_by_batch_size"],
    )


def default_backend(world_size: int, device: torch.device) -> str:
    """ "uni" at one rank; "ray" where a CUDA world is larger than this machine's GPUs
    and Ray is installed (the cluster has the rest); "mp" otherwise."""
    if world_size == 1:
        return "uni"
    if (
        device.type == "cuda"
        and world_size > torch.cuda.device_count()
        and importlib.util.find_spec("ray") is not None
    ):
        return "ray"
    return "mp"


def check_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """Refuses, before any worker starts, a tensor-parallel size the model cannot be
    sharded over (its attention heads, KV heads, MLP width; any size for a
    mixture-of-experts model, whose experts are not sharded yet; any parallelism for a
    latent-attention model), a pipeline that cannot
    split its layers (or an ASYNCLLM_PP_LAYER_PARTITION that does not fit them), or a
    device count that is not there; the message names the numbers."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    hf = model.hf_config
    if parallel.world_size > 1 and getattr(hf, "kv_lora_rank", None) is not None:
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}: "
            f"{model.architecture} uses latent attention (MLA), which runs on one GPU only "
            "until tested on several (set both to 1)"
        )
    if pp > 1:
        layers = int(getattr(hf, "num_hidden_layers", 0) or 0)
        try:
            stage_partition(layers, pp, envs.pp_layer_partition())
        except ValueError as e:
            raise ValueError(
                f"pipeline_parallel_size={pp} cannot split {model.architecture}: {e}"
            ) from None
    if model.device.type == "cuda" and parallel.distributed_executor_backend != "ray":
        first = model.device.index or 0
        have = torch.cuda.device_count()
        if first + parallel.world_size > have:
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs "
                f"{parallel.world_size} GPUs from cuda:{first} on, but {have} are visible"
            )
    if tp == 1:
        return
    what = f"tensor_parallel_size={tp} cannot shard {model.architecture}"
    if num_experts(hf) > 0:
        raise ValueError(
            f"{what}: its mixture-of-experts layers are not sharded yet (run it at "
            "tensor_parallel_size=1, or split its layers with pipeline_parallel_size)"
        )
    heads = int(getattr(hf, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    if heads:
        try:
            shard_attention_heads(heads, kv_heads, tp)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    inter = int(getattr(hf, "intermediate_size", 0) or 0)
    if inter and inter % tp:
        raise ValueError(f"{what}: its intermediate_size ({inter}) is not divisible by {tp}")


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


def resolved_config(config: EngineConfig) -> ResolvedConfig:
    """What the host side needs of a resolved configuration (sent to it as plain data)."""
    model, hf = config.model, config.model.hf_config
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ResolvedConfig(
        model=model.model,
        model_path=str(model.path),
        tokenizer=None if config.skip_tokenizer_init else model.tokenizer,
        architecture=model.architecture,
        load_format=model.load_format,
        max_model_len=model.max_model_len,
        vocab_size=int(hf.vocab_size),
        eos_token_id=eos,
        max_logprobs=config.max_logprobs,
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        async_scheduling=config.scheduler.async_scheduling,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        block_size=config.cache.block_size,
        attention_backend=config.attention_backend,
        enforce_eager=config.enforce_eager,
        hf_config=hf.to_dict(),
    )
