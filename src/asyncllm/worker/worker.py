"""A worker owns one device: it loads the model, profiles a step's memory, sizes and
allocates the KV cache, captures the CUDA graphs, and runs steps through its model runner.

KV cache size on CUDA (unless `num_gpu_blocks_override` or `kv_cache_memory_bytes` fix
it): `gpu_memory_utilization` x total memory is this engine's share (as in vLLM, a
per-instance limit: two engines on one GPU may take 0.4 each), minus what this engine
holds once the model is loaded and the profile's persistent buffers exist (weights,
buffers), minus the activation peak of a profiling step at the largest shapes, minus
the CUDA graphs' memory (measured on throwaway graphs of the largest and smallest
capture sizes over a one-block cache, before the KV cache exists because graphs bake in
its addresses; checked after the real capture). Never more than is free now (other
engines and processes, and the CUDA context, are left what they hold).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from asyncllm import envs
from asyncllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput
from asyncllm.worker.cuda_graph import GraphKey
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.runner_startup import RunnerStartup
from asyncllm.worker.step_result import StepResult

logger = logging.getLogger(__name__)

GRAPH_POOL_SLACK = 128 << 20  # allocator rounding on top of the graph estimate
FREE_MARGIN = 512 << 20  # never take the last of the free memory


@dataclass
class StartupReport:
    """What start-up measured (bytes and seconds); logged, and read by benchmarks."""

    seconds: dict[str, float] = field(default_factory=dict)  # stage -> time
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    graph_estimate_bytes: int = 0
    graph_bytes: int = 0
    num_blocks: int = 0
    kv_cache_bytes: int = 0
    max_concurrency: float = 0.0  # requests of max_model_len tokens the cache holds


class GraphMemoryError(RuntimeError):
    pass


def check_graph_memory(taken: int, estimate: int, free: int, activation_peak: int) -> str | None:
    """After the graphs' capture: None when they took no more than `estimate` (plus the
    allocator's slack); a warning when they took more but the device still has
    `activation_peak` plus FREE_MARGIN free (the engine then holds the overrun beyond
    its `gpu_memory_utilization` share, and runs safely); GraphMemoryError when less is
    left. (The estimate, from throwaway graphs of two sizes, can miss: docs/architecture.md,
    "Memory".)"""
    if taken <= estimate + GRAPH_POOL_SLACK:
        return None
    said = (
        f"the CUDA graphs took {taken / 2**20:.0f} MiB, {(taken - estimate) / 2**20:.0f} MiB "
        f"more than the {estimate / 2**20:.0f} MiB estimated before the KV cache was sized"
    )
    if free < activation_peak + FREE_MARGIN:
        raise GraphMemoryError(
            f"{said}, leaving {free / 2**20:.0f} MiB free for steps that may need "
            f"{(activation_peak + FREE_MARGIN) / 2**20:.0f}: lower gpu_memory_utilization, "
            "capture fewer sizes (cudagraph_capture_sizes) or set enforce_eager=True"
        )
    return f"{said}: this engine holds that much beyond its gpu_memory_utilization share"


def _mib_by_key(items: Iterable[tuple[GraphKey, int]]) -> str:
    return ", ".join(f"{key}: {b / 2**20:.1f}" for key, b in items)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            from asyncllm_kernels import pdl

            pdl.enable(envs.pdl_launch())
        path = envs.tiles_path()
        if path is not None:
            # A card's measured tiles ahead of the built-in ones (read on any device, so
            # that a wrong file fails the start alike).
            from asyncllm_kernels import tiles

            tiles.load(path)
            logger.info("kernel tiles from %s", path)
        torch.manual_seed(config.model.seed)
        # What the process held before this engine (other engines in it, for one).
        self._baseline = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        )
        self.runner = ModelRunner(config)
        self.startup = RunnerStartup(self.runner)
        self.report = StartupReport()

    def load_model(self) -> None:
        t0 = time.monotonic()
        self.runner.load_model()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.report.weights_bytes = torch.cuda.memory_allocated(self.device) - self._baseline
        self.report.seconds["load weights"] = time.monotonic() - t0

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        block_bytes = self.runner.kv_cache_block_bytes()
        if self.device.type == "cuda":
            budget = self._profile_cuda_memory()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif cache.kv_cache_memory_bytes is not None:
            num_blocks = cache.kv_cache_memory_bytes // block_bytes
        else:
            num_blocks = int(max(budget, 0) // block_bytes)
        # (over all KV cache groups: a windowed group holds only its window's blocks)
        layout = self.runner.kv_layout
        needed = layout.blocks_per_request(self.config.model.max_model_len, cache.block_size)
        null = 1 if layout.hybrid else 0  # (the null block: see core/block_pool.py)
        if num_blocks < needed + null:
            raise ValueError(
                f"the KV cache has room for {num_blocks} blocks of {cache.block_size} tokens, but one "
                f"request of max_model_len={self.config.model.max_model_len} tokens needs "
                f"{needed + null}: give the cache more memory or lower max_model_len"
            )
        r = self.report
        r.num_blocks = num_blocks
        r.kv_cache_bytes = num_blocks * block_bytes
        r.max_concurrency = (num_blocks - null) / needed
        return num_blocks

    def _profile_cuda_memory(self) -> int:
        """Bytes the KV cache may take (see the module docstring)."""
        t0 = time.monotonic()
        dev, r = self.device, self.report
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        self.startup.profile_run()
        torch.cuda.synchronize(dev)
        after = torch.cuda.memory_allocated(dev)  # + penalty state and graph logits, kept
        r.activation_peak_bytes = torch.cuda.max_memory_allocated(dev) - after
        r.graph_estimate_bytes = self.startup.profile_decode_graph()
        torch.cuda.empty_cache()
        r.seconds["memory profile"] = time.monotonic() - t0
        free, total = torch.cuda.mem_get_info(dev)
        own = after - self._baseline  # this engine's weights and kept buffers
        util = self.config.cache.gpu_memory_utilization
        budget = util * total - own - r.activation_peak_bytes - r.graph_estimate_bytes
        budget = min(budget, free - r.activation_peak_bytes - r.graph_estimate_bytes - FREE_MARGIN)
        logger.info(
            "memory: weights %.2f GiB, activation peak %.2f GiB, CUDA graphs (estimated) "
            "%.2f GiB, this engine %.2f GiB, in use on the GPU %.2f of %.2f GiB; the KV "
            "cache may take %.2f GiB",
            r.weights_bytes / 2**30,
            r.activation_peak_bytes / 2**30,
            r.graph_estimate_bytes / 2**30,
            own / 2**30,
            (total - free) / 2**30,
            total / 2**30,
            max(budget, 0) / 2**30,
        )
        return int(budget)

    def initialize_cache(self, num_blocks: int) -> None:
        t0 = time.monotonic()
        self.runner.initialize_kv_cache(num_blocks)
        self.report.seconds["allocate KV cache"] = time.monotonic() - t0
        graphs = self.startup.capture_cuda_graphs()
        r = self.report
        if graphs is not None:
            r.seconds["capture CUDA graphs"] = graphs.capture_seconds
            r.graph_bytes = graphs.pool_bytes
            free = torch.cuda.mem_get_info(self.device)[0]
            warning = check_graph_memory(
                graphs.pool_bytes, r.graph_estimate_bytes, free, r.activation_peak_bytes
            )
            if warning is not None:
                costliest = sorted(graphs.bytes_by_key.items(), key=lambda kv: -kv[1])[:5]
                logger.warning(
                    "%s (the costliest captures, (sequences, query length): MiB: %s; the "
                    "estimate's throwaway captures: %s)",
                    warning,
                    _mib_by_key(costliest),
                    _mib_by_key(self.startup.probe_bytes_by_key.items()),
                )
        t0 = time.monotonic()
        if self.startup.warm_up_attention():
            r.seconds["warm up mixed steps"] = time.monotonic() - t0
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), %.1f requests of max_model_len=%d "
            "at once; start-up: %s",
            r.num_blocks,
            self.config.cache.block_size,
            r.kv_cache_bytes / 2**30,
            r.max_concurrency,
            self.config.model.max_model_len,
            ", ".join(f"{k} {v:.1f} s" for k, v in r.seconds.items()),
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepResult:
        return self.runner.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        """Releases the graphs, the KV cache and the model (device memory goes back at
        once)."""
        self.runner.graphs = None
        self.runner.graph_logits = None
        self.runner.kv_caches = []
        self.runner.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
