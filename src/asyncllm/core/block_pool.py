"""All KV blocks: a free queue in LRU order and the map from block hash to cached block.

Invariants (checked by the property tests):
- a block is in the free queue exactly when its ref count is 0;
- a block with a hash is in the hash map under that hash, and vice versa;
- freed blocks keep their hash (and stay findable) until they are handed out again,
  so cached blocks are evicted only when no plain free block is left.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash else "plain"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """A doubly linked list of free blocks: pop from the front (least recently freed),
    append at the back, and remove from the middle in O(1) when a cached block is reused."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail and b is not None:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks with ref count 1, evicting the least recently freed cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forgets these blocks' hashes: their K/V was never written."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Another request now uses these (cache hits): take them off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the free queue in this order
        (so pass a request's blocks tail first: its prefix is evicted last)."""
        for block in ordered:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Registers blocks[start:end], which are full, under their hashes."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a cache hit: already registered
            h = block_hashes[i]
            if h in self.cached:
                continue  # same content computed twice at once: keep the first, this one stays plain
            block.block_hash = h
            self.cached[h] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
