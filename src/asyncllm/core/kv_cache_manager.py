"""The scheduler's view of KV memory: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.core.kv_cache_coordinator import get_kv_cache_coordinator
from asyncllm.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    requests: int = 0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.coordinator = get_kv_cache_coordinator(self.pool, block_size, enable_caching)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks.

        The last token is always recomputed (its logits are needed), and requests that
        want prompt logprobs get no hit (every prompt position must be computed).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        blocks = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens (after any cache hit); None if they
        do not fit, in which case nothing changed."""
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        rid = request.request_id
        if not new_computed_blocks and not num_new_computed_tokens:
            # The common decode case: the blocks held already have room.
            num_tokens = min(request.num_computed_tokens + num_new_tokens, self.max_model_len)
            if self.coordinator.num_slots(rid) >= num_tokens:
                if num_tokens // self.block_size > request.num_computed_tokens // self.block_size:
                    self.coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))
                return []
        new_computed_blocks = new_computed_blocks or []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        need = self.coordinator.num_blocks_to_allocate(rid, num_tokens, new_computed_blocks)
        if need > self.pool.num_free_blocks:
            return None
        self.coordinator.save_new_computed_blocks(rid, new_computed_blocks)
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_tokens)
        # Blocks whose tokens this step computes are registered now: a request scheduled
        # later in the same step may hit them, since each layer writes K/V before reading.
        self.coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        # Blocks are cached when allocated, before their step runs. A request freed
        # before that (a priority victim given tokens earlier in the same step) must
        # not leave cached blocks past its computed tokens: they hold no K/V.
        blocks = self.coordinator.get_blocks(request.request_id)
        self.pool.uncache(blocks[request.num_computed_tokens // self.block_size :])
        self.coordinator.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.coordinator.get_blocks(request_id)]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
