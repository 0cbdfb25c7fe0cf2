"""Per-request block lists, one per KV cache group (`model/kv_groups.py`), over one
block pool.

`GroupBlocks` keeps one group's blocks per request and takes them from / gives them
back to the pool; `SlidingWindowBlocks` also frees the blocks that fall wholly out of
its window (the null block takes their place in the list, so a list's index stays a
block's place in the sequence). `KVCacheCoordinator` runs every group in step:
all of a request's groups cover the same tokens, a prefix-cache hit is found per group
and cut to the longest length every group can serve.

Each group registers its blocks in the prefix cache under its own keys (the hash of
the tokens, plus the group id after group 0): the same tokens have different K/V in
different groups' layers.
"""

from __future__ import annotations

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.core.kv_cache_utils import BlockHash
from asyncllm.core.request import Request
from asyncllm.model.kv_groups import KVCacheGroup, KVCacheLayout

# A request's blocks (or a step's new blocks, or a cache hit), one list per group;
# () when there are none in any group.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]


class GroupBlocks:
    """One full-attention group: each request's blocks, in token order."""

    def __init__(self, pool: BlockPool, block_size: int, group_id: int, caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.caching = caching
        self.suffix = group_id.to_bytes(2, "little") if group_id else b""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered already, so each
        # step registers only the blocks it completed
        self.num_cached_blocks: dict[str, int] = {}
        self.num_held = 0  # blocks in req_to_blocks, the null block not counted

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of this group's block of these tokens."""
        return block_hash + self.suffix if self.suffix else block_hash

    def find_hit(self, block_hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most `max_blocks` blocks this
        group can serve; takes no reference. Here: the leading blocks found."""
        hits = []
        for h in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(self.key(h))
            if block is None:
                break
            hits.append(block)
        return hits

    def cut_hit(self, hits: list[KVCacheBlock], num_blocks: int) -> list[KVCacheBlock] | None:
        """The hit cut to `num_blocks` blocks, or None if it must be looked up again."""
        return hits[:num_blocks]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks no query from `num_computed_tokens` on reads (none here)."""

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks can hold."""
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        """Free blocks it would take for the request to hold `num_tokens` tokens after
        adding the cache hits: the new blocks, plus the hits that sit in the free queue
        (taking them out of it shrinks it just the same)."""
        have = len(self.req_to_blocks.get(request_id, ())) + len(hits)
        need = -(-num_tokens // self.block_size) - have
        null = self.pool.null_block
        return max(need, 0) + sum(1 for b in hits if b.ref_cnt == 0 and b is not null)

    def save_hits(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        """Appends cache hits to the request's blocks, taking a reference on each."""
        if hits:
            self.pool.touch(hits)
            self.req_to_blocks.setdefault(request_id, []).extend(hits)
            null = self.pool.null_block
            self.num_held += sum(1 for b in hits if b is not null)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Appends fresh blocks until the request can hold `num_tokens` tokens; returns
        just those ([] if it already could). The caller checks they are free first."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need <= 0:
            return []
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        self.num_held += need
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Makes the request's full blocks within its first `num_tokens` tokens findable
        by later requests (a no-op without prefix caching)."""
        if not self.caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        done = self.num_cached_blocks.get(rid, 0)
        full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if full > done:
            keys = [self.key(h) for h in request.block_hashes[done:full]]
            self.pool.cache_full_blocks(blocks[done:full], keys, 0, full - done)
            self.num_cached_blocks[rid] = full

    def take(self, request_id: str) -> list[KVCacheBlock]:
        """Removes the request's blocks from its name and returns them, still held."""
        self.num_cached_blocks.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, [])
        null = self.pool.null_block
        self.num_held -= sum(1 for b in blocks if b is not null)
        return blocks


class SlidingWindowBlocks(GroupBlocks):
    """A group of layers attending through a window of `window` tokens: a query at
    position p reads the keys of positions p - window + 1 .. p."""

    def __init__(
        self, pool: BlockPool, block_size: int, group_id: int, caching: bool, window: int
    ) -> None:
        super().__init__(pool, block_size, group_id, caching)
        if pool.null_block is None:
            raise ValueError("a sliding-window group needs a pool with a null block")
        self.null_block: KVCacheBlock = pool.null_block
        self.window = window

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or later) reads."""
        return max(position - self.window + 1, 0) // self.block_size

    def find_hit(self, block_hashes: list[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix of at most `max_blocks` blocks whose last blocks, those a
        query right after it reads, are all cached; the null block before them."""
        best, last_miss = 0, -1
        found: list[KVCacheBlock | None] = []
        for e in range(1, min(max_blocks, len(block_hashes)) + 1):
            block = self.pool.get_cached_block(self.key(block_hashes[e - 1]))
            found.append(block)
            if block is None:
                last_miss = e - 1
            if last_miss < self.first_needed_block(e * self.block_size):
                best = e
        lo = self.first_needed_block(best * self.block_size)
        tail = found[lo:best]
        return [self.null_block] * lo + [b for b in tail if b is not None]

    def cut_hit(self, hits: list[KVCacheBlock], num_blocks: int) -> list[KVCacheBlock] | None:
        return None  # a shorter prefix needs other blocks: look it up again

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        freed = []
        for k in range(min(self.first_needed_block(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[k] is self.null_block:
                break  # (the ones before were freed earlier)
            freed.append(blocks[k])
            blocks[k] = self.null_block
        self.num_held -= len(freed)
        self.pool.free_blocks(freed)  # tail first: the oldest is evicted first


def _group_blocks(
    pool: BlockPool, block_size: int, gid: int, group: KVCacheGroup, caching: bool
) -> GroupBlocks:
    if group.sliding_window is None:
        return GroupBlocks(pool, block_size, gid, caching)
    return SlidingWindowBlocks(pool, block_size, gid, caching, group.sliding_window)


class KVCacheCoordinator:
    """Every KV cache group's blocks of each request. It takes no decision: the KV cache
    manager checks that blocks are free before asking for them."""

    def __init__(
        self, pool: BlockPool, block_size: int, layout: KVCacheLayout, caching: bool
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.caching = caching
        self.groups = [
            _group_blocks(pool, block_size, gid, group, caching)
            for gid, group in enumerate(layout.groups)
        ]

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_tokens: int
    ) -> tuple[KVCacheBlocks, int]:
        """Each group's cached blocks for the longest prefix of `block_hashes`, of at
        most `max_tokens` tokens, that every group can serve, and its length in tokens;
        takes no reference. Each group cuts the length to what it serves until none
        does: a full-attention hit's prefix is a hit too, a window's is looked up again."""
        if not self.caching:
            return (), 0
        n = min(max_tokens // self.block_size, len(block_hashes))
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.groups)
        while True:
            settled = True
            for i, group in enumerate(self.groups):
                found = hits[i]
                if found is not None and len(found) > n:
                    found = group.cut_hit(found, n)
                if found is None or len(found) > n:
                    found = group.find_hit(block_hashes, n)
                hits[i] = found
                if len(found) < n:
                    n, settled = len(found), False
            if settled and all(h is not None and len(h) == n for h in hits):
                break
        if n == 0:
            return (), 0
        return tuple(h for h in hits if h is not None), n * self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees each windowed group's blocks that no query from `num_computed_tokens`
        on reads."""
        for group in self.groups:
            group.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_slots(self, request_id: str) -> int:
        """Tokens the request's blocks can hold (the same in every group)."""
        return self.groups[0].num_slots(request_id)

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, hits: KVCacheBlocks) -> int:
        """Free blocks it would take, over all groups (see GroupBlocks)."""
        return sum(
            g.num_blocks_to_allocate(request_id, num_tokens, hits[i] if hits else [])
            for i, g in enumerate(self.groups)
        )

    def save_hits(self, request_id: str, hits: KVCacheBlocks) -> None:
        for group, found in zip(self.groups, hits):
            group.save_hits(request_id, found)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> KVCacheBlocks:
        """Each group's new blocks for the request to hold `num_tokens` tokens; () if
        none needed any."""
        new = tuple(g.allocate_new_blocks(request_id, num_tokens) for g in self.groups)
        return new if new[0] else ()

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.cache_blocks(request, num_tokens)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group, in token order (null blocks included); ()
        for a request holding none. The lists are the coordinator's: do not change them."""
        if request_id not in self.groups[0].req_to_blocks:
            return ()
        return tuple(g.req_to_blocks[request_id] for g in self.groups)

    def take(self, request_id: str) -> KVCacheBlocks:
        """Removes the request's blocks from its name and returns them, still held (the
        caller frees them, with `free_blocks`, when nothing can write them any more)."""
        taken = tuple(g.take(request_id) for g in self.groups)
        return taken if taken[0] else ()

    def free_blocks(self, blocks: KVCacheBlocks) -> None:
        """Releases blocks taken from a request, each group's tail first (see
        BlockPool.free_blocks; the null block is skipped)."""
        for group_blocks in blocks:
            self.pool.free_blocks(reversed(group_blocks))

    def num_held_blocks(self) -> list[int]:
        """Blocks each group's requests hold (a block shared by two counts once per
        holder; the null block not at all)."""
        return [g.num_held for g in self.groups]
