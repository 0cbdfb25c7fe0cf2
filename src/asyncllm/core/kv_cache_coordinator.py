"""Per-request block lists for one group of identical attention layers.

`UnitaryKVCacheCoordinator` serves models whose layers all share one KV layout, with
prefix caching; `NoPrefixCacheCoordinator` the same without it. A hybrid coordinator
(sliding-window plus full-attention groups) plugs in behind the same interface.
"""

from __future__ import annotations

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.core.kv_cache_utils import BlockHash
from asyncllm.core.request import Request


class KVCacheCoordinator:
    enable_caching = True

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_tokens: int
    ) -> list[KVCacheBlock]:
        hits = []
        for h in block_hashes[: max_tokens // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock]
    ) -> int:
        have = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        need = -(-num_tokens // self.block_size) - have
        # Cache hits sitting in the free queue are taken out of it: they count too.
        return max(need, 0) + sum(1 for b in new_computed if b.ref_cnt == 0)

    def save_new_computed_blocks(self, request_id: str, new_computed: list[KVCacheBlock]) -> None:
        if new_computed:
            self.pool.touch(new_computed)
            self.req_to_blocks.setdefault(request_id, []).extend(new_computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need <= 0:
            return []
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's full blocks up to `num_tokens` tokens."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        done = self.num_cached_blocks.get(rid, 0)
        full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if full > done:
            self.pool.cache_full_blocks(blocks, request.block_hashes, done, full)
            self.num_cached_blocks[rid] = full

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV layout for every layer, with prefix caching: the base behaviour as is."""


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    enable_caching = False

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_tokens: int
    ) -> list[KVCacheBlock]:
        return []

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return None


def get_kv_cache_coordinator(
    pool: BlockPool, block_size: int, enable_caching: bool
) -> KVCacheCoordinator:
    cls = UnitaryKVCacheCoordinator if enable_caching else NoPrefixCacheCoordinator
    return cls(pool, block_size)
