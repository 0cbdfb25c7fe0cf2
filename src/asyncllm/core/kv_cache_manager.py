"""The scheduler's view of KV memory: prefix-cache lookups, slot allocation, freeing."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.core.kv_cache_coordinator import KVCacheBlocks, KVCacheCoordinator
from asyncllm.core.request import Request
from asyncllm.model.kv_groups import KVCacheGroup, KVCacheLayout


@dataclass
class PrefixCacheStats:
    """Since start, counted at each lookup (a request refused admission and retried
    next step counts again)."""

    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found


def block_ids(blocks: KVCacheBlocks) -> list[list[int]]:
    """The ids of blocks, per KV cache group; [] for none."""
    return [[b.block_id for b in group] for group in blocks]


class KVCacheManager:
    """What the scheduler asks of KV memory, for the model's KV cache groups (one group
    of every layer unless `layout` says otherwise; a layout with windowed groups
    reserves block 0 as the null block, so `num_blocks` counts one fewer).
    `allocate_slots` succeeds whole or takes no block (it may free blocks that fell out
    of a window), so the scheduler can try, preempt someone, and try again."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        layout: KVCacheLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        layout = layout or KVCacheLayout((KVCacheGroup(None, ()),), 1)
        self.pool = BlockPool(num_blocks, reserve_null_block=layout.hybrid)
        self.coordinator = KVCacheCoordinator(self.pool, block_size, layout, enable_caching)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        """All blocks, held or free."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """The fraction of blocks held by requests, in [0, 1]."""
        return self.pool.usage()

    def num_held_blocks(self) -> list[int]:
        """Blocks held by requests, per KV cache group."""
        return self.coordinator.num_held_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a waiting request, in whole blocks per group,
        and its length in tokens; ((), 0) without prefix caching.

        The last token is never part of a hit (its logits are needed to sample), and a
        request that wants prompt logprobs gets no hit (every prompt position must be
        computed). No reference is taken: pass the result straight to `allocate_slots`,
        before anything else can evict the blocks. Counted in `stats`.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return (), 0
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        self.stats.queries += request.num_tokens
        self.stats.hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks = (),
    ) -> KVCacheBlocks | None:
        """Makes room for `num_new_tokens` tokens after the request's computed tokens
        and the cache hit (`new_computed_blocks`, `num_new_computed_tokens` tokens, from
        `get_computed_blocks`); slots past max_model_len are never allocated.

        Returns:
        - None: not enough free blocks. Nothing changed (the hits were not taken), so
          the caller may preempt someone and call again, or leave the request waiting;
        - (): no new block was needed; the blocks held (plus any hits, now taken) have
          room for the tokens;
        - otherwise the new blocks per group, in token order, now appended to the
          request's blocks after the hits. Only these are new to the runner: the hits
          are not in them, but `get_block_ids` has them.

        First, each windowed group frees the blocks no query of this step reads.

        Full blocks among the tokens this step computes are registered in the prefix
        cache at once, so a request scheduled later in the same step may hit them.
        ValueError if num_new_tokens is not positive.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        rid = request.request_id
        coordinator = self.coordinator
        if self.pool.null_block is not None:
            coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        if not new_computed_blocks and not num_new_computed_tokens:
            # The common decode case: the blocks held already have room.
            num_tokens = min(request.num_computed_tokens + num_new_tokens, self.max_model_len)
            if coordinator.num_slots(rid) >= num_tokens:
                if num_tokens // self.block_size > request.num_computed_tokens // self.block_size:
                    coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))
                return ()
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        need = coordinator.num_blocks_to_allocate(rid, num_tokens, new_computed_blocks)
        if need > self.pool.num_free_blocks:
            return None
        coordinator.save_hits(rid, new_computed_blocks)
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens)
        # Each layer writes a step's K/V before reading it, so blocks this step computes
        # can be hit by a request scheduled after this one in the same step.
        coordinator.cache_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Releases all the request's blocks (they stay in the prefix cache until
        evicted). Call it before resetting `num_computed_tokens`: blocks past the
        computed tokens are unregistered first, since their K/V was never written."""
        self.free_blocks(self.take_blocks(request))

    def take_blocks(self, request: Request) -> KVCacheBlocks:
        """Detaches the request's blocks from it (its id may be reused at once) but keeps
        them held, for a step still in flight that writes them; `free_blocks` releases
        them. Blocks past the computed tokens are unregistered, as in `free`."""
        # Blocks are registered when allocated, before their step runs; a request freed
        # in between (a priority victim given tokens earlier in the same step) must not
        # leave them findable.
        blocks = self.coordinator.take(request.request_id)
        for group in blocks:
            self.pool.uncache(group[request.num_computed_tokens // self.block_size :])
        return blocks

    def free_blocks(self, blocks: KVCacheBlocks) -> None:
        """Releases blocks from `take_blocks`."""
        self.coordinator.free_blocks(blocks)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The ids of the request's blocks per group, in token order (the null block's
        where a window dropped one); [] if it holds none."""
        return block_ids(self.coordinator.get_blocks(request_id))

    def blocks_from(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The request's blocks, over all groups, from the one holding token
        `num_tokens` on (the null block left out)."""
        first = num_tokens // self.block_size
        null = self.pool.null_block
        return [
            b
            for group in self.coordinator.get_blocks(request_id)
            for b in group[first:]
            if b is not null
        ]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache; False (and nothing done) while any block is held."""
        return self.pool.reset_prefix_cache()
