"""A worker owns one device: it loads the model, sizes and allocates the KV cache,
and runs steps through its model runner."""

from __future__ import annotations

import logging

import torch

from asyncllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput
from asyncllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        block_bytes = self.runner.kv_cache_block_bytes()
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif cache.kv_cache_memory_bytes is not None:
            num_blocks = cache.kv_cache_memory_bytes // block_bytes
        elif self.device.type == "cuda":
            # This engine may use gpu_memory_utilization of the card, weights included, and
            # never more than is free now (other processes may share the GPU).
            free, total = torch.cuda.mem_get_info(self.device)
            own = torch.cuda.memory_reserved(self.device)
            budget = min(cache.gpu_memory_utilization * total - own, free - (1 << 30))
            # Headroom for activations of the largest batch (logits dominate at small models).
            sched = self.config.scheduler
            hidden = self.config.model.hf_config.hidden_size
            activations = (
                sched.max_num_batched_tokens * (4 * hidden + 4 * self.runner.vocab_size // 8) * 4
            )
            num_blocks = int(max(budget - activations, 0) // block_bytes)
        else:
            num_blocks = DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
        needed = -(-self.config.model.max_model_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache has room for {num_blocks} blocks of {cache.block_size} tokens, but one "
                f"request of max_model_len={self.config.model.max_model_len} tokens needs {needed}: "
                "give the cache more memory or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            cache.block_size,
            num_blocks * block_bytes / 2**20,
        )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Releases the KV cache and the model (device memory goes back at once)."""
        self.runner.kv_caches = []
        self.runner.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
