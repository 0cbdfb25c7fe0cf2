"""All KV blocks: a free queue in LRU order and the map from block hash to cached block.

Invariants (checked by the property tests):
- a block is in the free queue exactly when its ref count is 0;
- a block with a hash is in the hash map under that hash, and vice versa;
- freed blocks keep their hash (and stay findable) until they are handed out again,
  so a cached block is evicted only when it reaches the front of the free queue.

The pool does not decide what gets cached: the KV cache coordinator registers blocks
(prefix caching off: it never does, and the hash map stays empty).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from asyncllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    """One block of KV memory. `ref_cnt` counts the requests holding it; `block_hash`
    is set while the block is registered in the prefix cache."""

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
    append at the back, and remove from the middle in O(1) when a cached block is reused.

    The links live in the blocks themselves, so a block is in the queue exactly when
    its links are set; the two sentinels keep every operation branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the least recently appended block; IndexError if empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Takes `block` out wherever it is, in O(1); ValueError if it is not queued."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queues `block` last (most recently freed); ValueError if it is queued already."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free, block.next_free = last, self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back: the order in which popleft would hand the blocks out."""
        b = self._head.next_free
        while b is not self._tail and b is not None:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every block, its reference count, and the prefix cache's hash map.

    With `reserve_null_block`, block 0 is the null block: never handed out, freed or
    written (its K/V stays zero), it stands in a sliding-window group's block table for
    the blocks that fell out of the window; `num_blocks` then counts the others."""

    def __init__(self, num_blocks: int, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(
                f"num_blocks must be at least {1 + reserve_null_block}, got {num_blocks}"
            )
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.ref_cnt = 1  # (held for good: never in the free queue)
        usable = self.blocks[1:] if reserve_null_block else self.blocks
        self.num_blocks = len(usable)
        self.free_queue = FreeBlockQueue(usable)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evictable)."""
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """The fraction of blocks held by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under `block_hash`, held or free, or None. Takes no
        reference: call `touch` to keep it."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """n blocks from the front of the free queue, each with ref count 1 and no hash
        (a cached one is evicted from the hash map). ValueError, and nothing taken, if
        fewer than n are free."""
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
        """Unregisters these blocks from the prefix cache, because their K/V will never
        be written; their ref counts and queue places do not change."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (cache hits another request now shares); a
        free one leaves the free queue, so it cannot be handed out or evicted. The null
        block is skipped."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the back of the free queue
        in this order (pass a request's blocks tail first, so its prefix, the part
        other requests are likeliest to share, is evicted last). They keep their hashes.
        ValueError on a block with no reference left; the blocks before it are freed.
        The null block is skipped."""
        for block in ordered:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Registers blocks[start:end] under block_hashes[start:end]. The caller vouches
        that they are full and that their K/V is written before anyone reads it. A block
        already registered (a cache hit) is skipped; so is one whose hash another block
        holds (the same content computed twice at once): the first stays, this one
        stays plain. The null block is never registered."""
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                continue
            h = block_hashes[i]
            if h in self.cached:
                continue
            block.block_hash = h
            self.cached[h] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block and returns True, or returns False and changes
        nothing while any block is held (a running request's blocks must stay valid)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None  # (the null block has none)
        self.cached.clear()
        return True
