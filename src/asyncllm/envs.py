"""Every `ASYNCLLM_*` environment variable, read here and nowhere else.

A leaf module (standard library only). Values are read when asked for, not at import,
so a test or a host that sets a variable before starting an engine is heard.

- `ASYNCLLM_CACHE`: folder for converted models (default `~/.cache/asyncllm`).
- `ASYNCLLM_CPU_PACKING`: `0` turns off prepacked oneDNN weights for float32 on the CPU
  (default `1`).
- `ASYNCLLM_LOG_LEVEL`: the engine-core process's logging level (default `WARNING`).
- `ASYNCLLM_GC_FREEZE`: `0` keeps the objects start-up leaves (torch's, transformers',
  the model's) in the garbage collector's generations; by default they are frozen once
  an engine has started, so full collections no longer walk them (default `1`).
- `ASYNCLLM_API_KEY`: the key `asyncllm serve` requires on /v1 when `--api-key` is not
  given.
- `ASYNCLLM_PROGRESS`: `0` hides the progress bars of model conversion and weight
  loading (`asyncllm ... --quiet` sets it); by default they are drawn on stderr when it
  is a terminal (default `1`).
- `ASYNCLLM_GRAMMAR_THREADS`: the most threads the grammar process splits a step's
  accepts and bitmask fill over (default: half the CPUs this process may use, at most 4;
  a thread gets at least 16 rows).
- `ASYNCLLM_GRAMMAR_DEVICE_STEPS`: `0` has the host relay a constrained step's tokens to
  the grammar process and queue its sampling once the bitmask is filled, as on the CPU;
  by default, on CUDA with async scheduling, the device does both (default `1`).
- `ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S`: how long the multiprocess (or Ray) executor waits for a
  model step's result from its workers before the engine fails with a TimeoutError
  naming it (a worker stuck in a collective or a step; default `300`).
- `ASYNCLLM_PP_LAYER_PARTITION`: comma-separated decoder-layer counts per pipeline stage
  (e.g. `12,12`), overriding the even split; read only at `pipeline_parallel_size` > 1.
- `ASYNCLLM_FLASHINFER_SAMPLING`: `1` has FlashInfer's sorting-free kernel draw the top-k
  / top-p rows that have no seed of their own, on CUDA where FlashInfer is installed
  (default `0`, the torch path: the kernel compiles on first use, for over 110 s on a
  16-core H100 host, and no measurement has shown it faster here).
- `ASYNCLLM_FUSED_KV_WRITE`: `0` has the attention backend's own launch write each
  step's K/V into the paged cache, after the rotary launch, instead of that launch
  (for measuring the fusion; default `1`).
- `ASYNCLLM_FUSED_GEMM`: `1` runs the RMSNorm before a small decode batch's linear
  layer, silu(gate) * up after its gate/up projection and the residual add after its
  output projections in the layer's GEMM launch instead of launches of their own; the
  norms' weights are folded into the projections after them at load time (default `0`:
  a first form made batch-1 decode 2.8x slower on an H100 on the Llama-3.1-8B shape;
  docs/benchmarks.md).
- `ASYNCLLM_PDL`: `1` launches a decoder layer's Triton kernels on sm_90 and later GPUs with
  programmatic dependent launch, so that in a CUDA graph each one's programs are placed
  while the previous kernel's last ones run (asyncllm_kernels/pdl.py; default `0`).
- `ASYNCLLM_MOE_ROUTED`: `1` has a mixture-of-experts layer on CUDA route a step of up
  to 4 tokens inside its experts' gate/up GEMM (`fused_moe_routed`: one launch less a
  layer) instead of in a routing launch of its own (default `0` until measured on a GPU).
- `ASYNCLLM_TILES`: a tiles file (JSON) whose kernel tiles a worker puts ahead of the
  built-in tables (they serve CUDA): the skinny GEMM's per shape and M, the MoE small
  path's per token count and shape (`asyncllm_kernels/tiles.py`;
  `benchmarks/kernels/pick_tiles.py` writes one from the sweeps). A file that is missing
  or wrong fails the start, naming the field (default: none).
- `ASYNCLLM_WORKER_START_TIMEOUT_S`: how long the multiprocess (or Ray) executor waits for
  every worker to build its model before the start fails, naming the ranks not ready (a
  rendezvous that never completes, a stalled load; default `900`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

VARIABLES = (
    "ASYNCLLM_CACHE",
    "ASYNCLLM_CPU_PACKING",
    "ASYNCLLM_LOG_LEVEL",
    "ASYNCLLM_GC_FREEZE",
    "ASYNCLLM_API_KEY",
    "ASYNCLLM_PROGRESS",
    "ASYNCLLM_GRAMMAR_THREADS",
    "ASYNCLLM_GRAMMAR_DEVICE_STEPS",
    "ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S",
    "ASYNCLLM_PP_LAYER_PARTITION",
    "ASYNCLLM_WORKER_START_TIMEOUT_S",
    "ASYNCLLM_FLASHINFER_SAMPLING",
    "ASYNCLLM_FUSED_KV_WRITE",
    "ASYNCLLM_FUSED_GEMM",
    "ASYNCLLM_PDL",
    "ASYNCLLM_MOE_ROUTED",
    "ASYNCLLM_TILES",
)
PP_LAYER_PARTITION = "ASYNCLLM_PP_LAYER_PARTITION"


def cache_root() -> Path:
    """Where converted models live: $ASYNCLLM_CACHE, default ~/.cache/asyncllm."""
    value = os.environ.get("ASYNCLLM_CACHE")
    return Path(value) if value else Path.home() / ".cache" / "asyncllm"


def cpu_packing_enabled() -> bool:
    return os.environ.get("ASYNCLLM_CPU_PACKING", "1") != "0"


def flashinfer_sampling_enabled() -> bool:
    """Whether FlashInfer may draw top-k / top-p rows (asked for with
    ASYNCLLM_FLASHINFER_SAMPLING=1, and installed)."""
    if os.environ.get("ASYNCLLM_FLASHINFER_SAMPLING", "0") != "1":
        return False
    return importlib.util.find_spec("flashinfer") is not None


def _switch(name: str, default: str) -> bool:
    """A variable that is 0 or 1; anything else is refused, naming it."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def fused_kv_write() -> bool:
    """Whether the rotary launch may write the step's K/V into the cache
    ($ASYNCLLM_FUSED_KV_WRITE, default 1)."""
    return _switch("ASYNCLLM_FUSED_KV_WRITE", "1")


def fused_gemm() -> bool:
    """Whether a small decode batch's linear layers take in the norm before them, the
    gate or the residual add after them ($ASYNCLLM_FUSED_GEMM, default 0)."""
    return _switch("ASYNCLLM_FUSED_GEMM", "0")


def pdl_launch() -> bool:
    """Whether asyncllm's Triton kernels are launched with programmatic dependent launch
    ($ASYNCLLM_PDL, default 0)."""
    return _switch("ASYNCLLM_PDL", "0")


def moe_routed() -> bool:
    """Whether a mixture-of-experts layer on CUDA routes a few tokens inside its gate/up
    GEMM ($ASYNCLLM_MOE_ROUTED, default 0)."""
    return _switch("ASYNCLLM_MOE_ROUTED", "0")


def tiles_path() -> str | None:
    """The tiles file a worker applies ($ASYNCLLM_TILES), or None."""
    return os.environ.get("ASYNCLLM_TILES") or None


def log_level() -> str:
    return os.environ.get("ASYNCLLM_LOG_LEVEL", "WARNING").upper()


def child_process_env() -> dict[str, str]:
    """Our environment for a child process of asyncllm's (`python -m asyncllm....`), with
    the folders asyncllm (and its kernels) were imported from on PYTHONPATH, so a source
    checkout works without installing."""
    roots = [str(Path(__file__).resolve().parents[1])]  # .../<root>/asyncllm/envs.py
    kernels = importlib.util.find_spec("asyncllm_kernels")
    if kernels is not None and kernels.origin is not None:
        roots.append(str(Path(kernels.origin).resolve().parents[1]))
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(roots + ([old] if old else []))
    return env


def cache_env(path: str) -> dict[str, str]:
    """The environment entry that points a child process's cache at `path`."""
    return {"ASYNCLLM_CACHE": path}


def gc_freeze_enabled() -> bool:
    return os.environ.get("ASYNCLLM_GC_FREEZE", "1") != "0"


def api_key() -> str | None:
    """The key `asyncllm serve` requires on /v1 when --api-key is not given."""
    return os.environ.get("ASYNCLLM_API_KEY") or None


def progress_enabled() -> bool:
    return os.environ.get("ASYNCLLM_PROGRESS", "1") != "0"


def hide_progress() -> None:
    """ASYNCLLM_PROGRESS=0 here and in the engine-core processes started from here."""
    os.environ["ASYNCLLM_PROGRESS"] = "0"


def available_cpus() -> list[int]:
    """The CPUs this process may run on (what sizes the engine's thread pools)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        return list(range(os.cpu_count() or 1))


def grammar_device_steps() -> bool:
    """Whether a constrained step's grammar handshake runs on the device where it can
    ($ASYNCLLM_GRAMMAR_DEVICE_STEPS, default 1; 0: the host relays the tokens and
    queues the sampling once the bitmask is filled, as on the CPU)."""
    value = os.environ.get("ASYNCLLM_GRAMMAR_DEVICE_STEPS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"ASYNCLLM_GRAMMAR_DEVICE_STEPS must be 0 or 1, got {value!r}")
    return value == "1"


def grammar_threads() -> int:
    """The grammar process's threads for a step's accepts and fill
    ($ASYNCLLM_GRAMMAR_THREADS; default half the usable CPUs, 1 to 4: on the H200 host
    64 rows filled in 1,567 µs on 1 thread, 890 on 4 and 1,066 on 8)."""
    value = os.environ.get("ASYNCLLM_GRAMMAR_THREADS")
    if value is None:
        return max(1, min(4, len(available_cpus()) // 2))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ASYNCLLM_GRAMMAR_THREADS must be a positive int, got {value!r}")
    return int(value)


def _positive_seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def execute_model_timeout_s() -> float:
    """How long the multiprocess executor waits for one step's result
    ($ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S, seconds, default 300)."""
    value = os.environ.get("ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S", "300")
    return _positive_seconds("ASYNCLLM_EXECUTE_MODEL_TIMEOUT_S", value)


def worker_start_timeout_s() -> float:
    """How long the multiprocess executor waits for its workers to start
    ($ASYNCLLM_WORKER_START_TIMEOUT_S, seconds, default 900)."""
    value = os.environ.get("ASYNCLLM_WORKER_START_TIMEOUT_S", "900")
    return _positive_seconds("ASYNCLLM_WORKER_START_TIMEOUT_S", value)


def pp_layer_partition() -> str | None:
    """The layers per pipeline stage that $ASYNCLLM_PP_LAYER_PARTITION asks for ("12,12"),
    or None when it is unset or empty."""
    return os.environ.get("ASYNCLLM_PP_LAYER_PARTITION") or None
