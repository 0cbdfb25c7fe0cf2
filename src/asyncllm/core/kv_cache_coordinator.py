"""Per-request block lists for one group of identical attention layers.

`KVCacheCoordinator` keeps each request's blocks and takes them from / gives them back
to the block pool; its subclasses decide what the prefix cache does:
`UnitaryKVCacheCoordinator` (every layer shares one KV layout) looks up and registers
full blocks, `NoPrefixCacheCoordinator` does neither. A hybrid coordinator (sliding-
window plus full-attention groups) would plug in behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.core.kv_cache_utils import BlockHash
from asyncllm.core.request import Request


class KVCacheCoordinator(ABC):
    """Each request's blocks, in token order (`req_to_blocks`). It takes no decision:
    the KV cache manager checks that blocks are free before asking for them."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_tokens: int
    ) -> list[KVCacheBlock]:
        """The cached blocks for the longest prefix of `block_hashes` that fits in
        `max_tokens` tokens; takes no reference (save_new_computed_blocks does)."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Makes the request's full blocks within its first `num_tokens` tokens
        findable by later requests (a no-op without prefix caching)."""

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in token order; [] for a request holding none. The list
        is the coordinator's own: read it, do not change it."""
        return self.req_to_blocks.get(request_id, [])

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock]
    ) -> int:
        """Free blocks it would take for the request to hold `num_tokens` tokens after
        adding the cache hits `new_computed`: the new blocks, plus the hits that sit in
        the free queue (taking them out of it shrinks it just the same)."""
        have = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
        need = -(-num_tokens // self.block_size) - have
        return max(need, 0) + sum(1 for b in new_computed if b.ref_cnt == 0)

    def save_new_computed_blocks(self, request_id: str, new_computed: list[KVCacheBlock]) -> None:
        """Appends cache hits to the request's blocks, taking a reference on each."""
        if new_computed:
            self.pool.touch(new_computed)
            self.req_to_blocks.setdefault(request_id, []).extend(new_computed)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Appends fresh blocks until the request can hold `num_tokens` tokens; returns
        just those ([] if it already could). The caller checks they are free first."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need <= 0:
            return []
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        return new

    def take(self, request_id: str) -> list[KVCacheBlock]:
        """Removes the request's blocks from its name and returns them, still held (the
        caller frees them, with `free_blocks`, when nothing can write them any more)."""
        return self.req_to_blocks.pop(request_id, [])

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Releases blocks taken from a request, tail first (see BlockPool.free_blocks)."""
        self.pool.free_blocks(reversed(blocks))


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV layout for every layer, with prefix caching."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        super().__init__(block_pool, block_size)
        # request id -> how many of its leading blocks are registered already, so each
        # step registers only the blocks it completed
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

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        done = self.num_cached_blocks.get(rid, 0)
        full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if full > done:
            self.pool.cache_full_blocks(blocks, request.block_hashes, done, full)
            self.num_cached_blocks[rid] = full

    def take(self, request_id: str) -> list[KVCacheBlock]:
        self.num_cached_blocks.pop(request_id, None)
        return super().take(request_id)


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: no lookups, and no block is ever registered."""

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_tokens: int
    ) -> list[KVCacheBlock]:
        return []

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return None


def get_kv_cache_coordinator(
    pool: BlockPool, block_size: int, enable_caching: bool
) -> KVCacheCoordinator:
    """The coordinator for the configuration: with or without prefix caching."""
    cls = UnitaryKVCacheCoordinator if enable_caching else NoPrefixCacheCoordinator
    return cls(pool, block_size)
