"""Engine arguments (what a user passes) and the resolved model configuration."""

from __future__ import annotations

import enum
import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float", "float16", "half", "bfloat16")  # and "auto"
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")  # and any Executor subclass as "module:Class"


def is_torch_object(value: Any, type_name: str) -> bool:
    """isinstance(value, torch.<type_name>) without importing torch here: this module is
    a leaf that the torch-free scheduler imports."""
    t = type(value)
    return t.__module__ == "torch" and t.__name__ == type_name


class HFConfig:
    """A model's Hugging Face config as transformers read it (every field, its defaults
    filled in: `PretrainedConfig.to_dict()`), held as plain attributes. The host reads it
    and sends the fields to the engine core, which so never imports transformers (about
    2.5 s of its start)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:  # (only for fields the config lacks)
        raise AttributeError(f"the model's config has no field {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__!r})"


def num_experts(hf_config: Any) -> int:
    """A mixture-of-experts config's routed experts per layer (0: a dense model), under
    any of its names (transformers 5 writes Qwen3-MoE's `num_experts` as
    `num_local_experts`; DeepSeek's is `n_routed_experts`)."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(hf_config, name, None)
        if n:
            return int(n)
    return 0


@dataclass
class ModelConfig:
    """A model resolved to a local folder, with its Hugging Face config."""

    model: str | None  # what the user named (None: the embedded default)
    path: Path  # local folder with config.json and weights (or the folder of a GGUF)
    hf_config: HFConfig
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
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    hybrid_kv_cache: bool = True  # windowed layers in groups of their own (kv_groups.py)


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one prefill's chunk
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_waiting_requests: int | None = None  # beyond this, new requests are refused
    async_scheduling: bool = True  # schedule step N+1 while step N runs (as EngineArgs)
    # Whether every rank holds the tokens the runner samples. False under pipeline
    # parallelism: a request is not scheduled while a token of it is being sampled, and
    # each step lists the tokens its requests compute (`CachedRequestData.new_token_ids`).
    runner_holds_samples: bool = True
    speculative: SpeculativeConfig | None = None  # (EngineArgs.speculative_config)


SPECULATIVE_METHODS = ("ngram", "ngram_gpu")  # (one method: prompt lookup)
# (measured on an H100 with SmolLM2: speculation paid up to batch 6, lost from 8 on;
# docs/benchmarks.md)
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (see core/ngram_proposer.py): up to
    `num_speculative_tokens` drafts per step for a request admitted while fewer than
    `disable_by_batch_size` requests were in the engine (decided once, for its life)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE


def check_speculative_config(value: Any) -> dict[str, Any] | None:
    """EngineArgs.speculative_config as vLLM takes it, checked and completed: a dict (or
    its JSON, from the command line) with "method" ("ngram"; "ngram_gpu" is the same
    method here), "num_speculative_tokens" (required), "prompt_lookup_min" and
    "prompt_lookup_max" (either defaults to the other, both to 5), and asyncllm's
    "disable_by_batch_size"; ValueError or TypeError naming the key otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a dict or its JSON: {e}") from None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size"}  # fmt: skip
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported key(s) {unknown} (supported: {sorted(known)})"
        )
    method = value.get("method", "ngram")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config['method'] must be one of {list(SPECULATIVE_METHODS)}, "
            f"got {method!r} (draft models, EAGLE and MTP are not supported)"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config['num_speculative_tokens'] is required")
    k = value["num_speculative_tokens"]
    _check_int("speculative_config['num_speculative_tokens']", k, 1)
    given_lo, given_hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if given_lo is None and given_hi is None:
        given_lo = given_hi = 5
    lo: Any = given_lo if given_lo is not None else given_hi
    hi: Any = given_hi if given_hi is not None else given_lo
    _check_int("speculative_config['prompt_lookup_min']", lo, 1)
    _check_int("speculative_config['prompt_lookup_max']", hi, 1)
    if lo > hi:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
        )
    limit = value.get("disable_by_batch_size", DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE)
    _check_int("speculative_config['disable_by_batch_size']", limit, 1)
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
        "disable_by_batch_size": limit,
    }


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni", "mp", "ray" or "module:Class" (resolved: None only where built by hand, as "uni")
    distributed_executor_backend: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    logits_processors: list[str]
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False
    max_logprobs: int = 20
    attention_backend: str | None = None
    # Decode batch sizes with a CUDA graph (sorted; empty: every step runs eager).
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    ubatch: str | int = "off"  # as EngineArgs.ubatch (checked)
    cpu_threads: int | None = None  # as the user set it (see engine/cpu_threads.py)


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# Defaults that depend on the device: (max_num_seqs, max_num_batched_tokens).
CUDA_BATCH_DEFAULTS = (1024, 16384)
CPU_BATCH_DEFAULTS = (128, 2048)


def default_capture_sizes(max_num_seqs: int, limit: int = 512) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (capped at `limit`; larger decode
    batches run eager)."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top + 1, 8))
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def check_ubatch(value: Any) -> str | int:
    """EngineArgs.ubatch as given: 'off', 'auto', or an int of at least 2 (from the
    command line, its digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, str):
        if value not in ("off", "auto"):
            raise ValueError(f"ubatch must be 'off', 'auto' or an int of at least 2, got {value!r}")
        return value
    _check_int("ubatch", value, 2)
    return int(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass
class EngineArgs:
    """Everything a user can set when starting an engine; validated on creation."""

    model: str | None = None
    """A local folder, a GGUF file or a Hugging Face hub id; None: the embedded
    SmolLM2-135M-Instruct."""
    tokenizer: str | None = None
    """Where the tokenizer comes from; None: the model's folder."""
    skip_tokenizer_init: bool = False
    """No tokenizer: prompts must be token ids and outputs carry no text."""
    dtype: str | torch.dtype = "auto"
    """float32, float16 or bfloat16; auto: bfloat16 on a GPU, float32 on the CPU."""
    device: str | torch.device = "auto"
    """cpu, cuda or cuda:N; auto: the first GPU if there is one."""
    seed: int = 0
    """The seed of the engine's random sampling (per request: SamplingParams.seed)."""
    max_model_len: int | None = None
    """The longest prompt plus output, in tokens; None: the model's own limit."""
    block_size: int = 16
    """Tokens per KV cache block (a power of two)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before."""
    disable_hybrid_kv_cache_manager: bool = False
    """Keep every token's KV in every layer, sliding-window layers too (by default a
    windowed layer frees the blocks that fall out of its window)."""
    enable_chunked_prefill: bool = True
    """Split long prompts over steps, mixed with running decodes."""
    max_num_seqs: int | None = None
    """Requests in one batch at most; None: 1024 on CUDA, 128 on the CPU."""
    max_num_batched_tokens: int | None = None
    """Tokens in one step at most; None: 16384 on CUDA, 2048 on the CPU."""
    long_prefill_token_threshold: int = 0
    """A prompt's chunk per step at most when others wait (0: no limit)."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served) or priority (lower SamplingParams priority first)."""
    num_gpu_blocks_override: int | None = None
    """Exactly this many KV cache blocks, whatever the memory would hold."""
    kv_cache_memory_bytes: int | None = None
    """Bytes of KV cache, instead of a fraction of the GPU's memory."""
    gpu_memory_utilization: float = 0.9
    """The fraction of the GPU's memory the engine may use (weights, KV cache, work)."""
    enforce_eager: bool = False
    """No CUDA graphs: every step runs eager."""
    cudagraph_capture_sizes: list[int] | None = None
    """Decode batch sizes captured as CUDA graphs; None: 1, 2, 4, 8, then every 8 up to
    min(max_num_seqs, 512). Larger decode batches and mixed steps run eager."""
    ubatch: str | int = "off"
    """Micro-batches: N (2 or more) splits each step the model runs eagerly (prefills and
    mixed steps, never a decode graph) of at least N requests into N parts of whole
    requests, balanced by tokens, each on a CUDA stream of its own so that one part's
    GEMMs can overlap another's attention; 'auto': only where a measurement recorded in
    worker/ubatch.py says it pays; 'off'."""
    load_format: str = "auto"
    """auto, safetensors, pt, gguf (the model's weights) or dummy (random weights of
    the model's shape)."""
    revision: str | None = None
    """The hub revision (branch, tag or commit) of a hub model."""
    tensor_parallel_size: int = 1
    """Ranks each layer is split over (one worker process per rank, one GPU each on
    CUDA; gloo over loopback on the CPU). The model's attention heads must divide by it,
    and its KV heads divide by it or it by them (KV heads are then replicated)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages the decoder layers are split into (contiguous layers each, one
    worker process per stage and TP rank; ASYNCLLM_PP_LAYER_PARTITION overrides the even
    split)."""
    distributed_executor_backend: str | None = None
    """The executor: uni (the model in the engine core's process, one rank only), mp
    (one worker process per rank, steps broadcast over shared memory), ray (one Ray
    actor per rank, on the nodes of a Ray cluster: the `asyncllm[ray]` extra) or an
    Executor subclass as module:Class; None: uni at one rank, mp above on one node, ray
    where a CUDA world is larger than this machine's GPUs and Ray is installed."""
    logits_processors: list[str] | None = None
    """Logits processor classes (module:Class) applied to every request."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 2, "prompt_lookup_max": 5} drafts up to k tokens per step from
    the request's own context (the longest recurring suffix) and verifies them in one
    forward pass; the output is what the model would give without it. Requests admitted
    while "disable_by_batch_size" (default 8) or more are in the engine do not
    speculate, and none drafts while that many are running. A constrained request's
    drafts are checked by its grammar. Not with pipeline parallelism yet."""
    max_logprobs: int = 20
    """The most logprobs (or prompt_logprobs) a request may ask for."""
    max_waiting_requests: int | None = None
    """Beyond this many waiting requests, new ones are refused (EngineOverloadedError)."""
    attention_backend: str | None = None
    """A registered attention backend (triton on CUDA, flashinfer on CUDA with the
    flashinfer extra installed, flashinfer_prefill (Triton's decodes, FlashInfer's
    prefill chunks) likewise, flash_attn on CUDA with the flash-attn extra (FlashAttention
    4), torch_native anywhere; triton_mla and torch_mla for
    latent-attention models; or one registered in registry.py); 'auto' or None: the
    first that supports the device, dtype, head size and model's features."""
    async_scheduling: bool = True
    """The host schedules and prepares step N+1 while the device runs step N (the
    sampled ids go from one step to the next on the device); off: one step at a time."""
    cpu_threads: int | None = None
    """torch's intra-op threads for the engine core's CPU work; None: one per CPU the
    core may use, lowered while other processes keep CPUs busy (engine/cpu_threads.py),
    or OMP_NUM_THREADS where it is set. With the mp executor: each worker's; None: the
    usable CPUs shared out among the workers (at least one each)."""

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise TypeError(f"model must be a str path or hub id, got {type(self.model).__name__}")
        if self.model is not None:
            self.model = os.fspath(self.model)
            if not self.model.strip():
                raise ValueError("model must not be empty (use None for the embedded default)")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise TypeError(f"tokenizer must be a str, got {type(self.tokenizer).__name__}")
        _check_int("seed", self.seed, -(2**63))
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
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype {self.dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPE_NAMES))}"
            )
        if not isinstance(self.dtype, str) and not is_torch_object(self.dtype, "dtype"):
            raise TypeError(f"dtype must be a str or torch.dtype, got {type(self.dtype).__name__}")
        if not isinstance(self.device, str) and not is_torch_object(self.device, "device"):
            raise TypeError(
                f"device must be a str or torch.device, got {type(self.device).__name__}"
            )
        for name in (
            "skip_tokenizer_init",
            "enable_prefix_caching",
            "disable_hybrid_kv_cache_manager",
            "enable_chunked_prefill",
            "enforce_eager",
            "async_scheduling",
        ):
            _check_bool(name, getattr(self, name))
        _check_int("max_num_seqs", self.max_num_seqs, 1, optional=True)
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not isinstance(sizes, list | tuple):
                raise TypeError("cudagraph_capture_sizes must be a list of ints")
            for size in sizes:
                _check_int("cudagraph_capture_sizes[]", size, 1)
            self.cudagraph_capture_sizes = sorted(set(sizes))
        self.ubatch = check_ubatch(self.ubatch)
        self.speculative_config = check_speculative_config(self.speculative_config)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        _check_int("max_logprobs", self.max_logprobs, 0)
        _check_int("max_waiting_requests", self.max_waiting_requests, 1, optional=True)
        _check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        g = self.gpu_memory_utilization
        if not isinstance(g, int | float) or isinstance(g, bool) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.attention_backend is not None and (
            not isinstance(self.attention_backend, str) or not self.attention_backend
        ):  # (whether it names a registered backend: the core's start-up checks)
            raise ValueError(
                "attention_backend must be 'auto', None or a registered backend's name, "
                f"got {self.attention_backend!r}"
            )
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS + (None,) and not (
            isinstance(backend, str) and ":" in backend
        ):
            raise ValueError(
                f"distributed_executor_backend {backend!r} is not available (this version has "
                "'uni', the in-process executor, 'mp', one worker process per rank, 'ray', one "
                "Ray actor per rank, or an Executor subclass named 'module:Class')"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend 'ray' needs Ray, which is not installed: "
                "pip install 'asyncllm[ray]'"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if backend == "uni" and world > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank in the engine core's "
                f"process, but tensor_parallel_size={self.tensor_parallel_size} x "
                f"pipeline_parallel_size={self.pipeline_parallel_size} needs {world} ranks: "
                "use 'mp' (or leave it None)"
            )
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, list | tuple) or not all(
                isinstance(p, str) for p in self.logits_processors
            ):
                raise TypeError("logits_processors must be a list of import-path strings")
            self.logits_processors = list(self.logits_processors)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens is not None:
            if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "without chunked prefill, max_num_batched_tokens must be at least max_model_len"
                )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
