"""The block pool and the KV cache manager.

The pool's rules: free blocks form one LRU list (handed out least recently freed first);
a freed block keeps its hash and stays findable in the prefix cache until it is handed
out again; a cache hit on a free block takes it off the free list; reference counts
never go below zero. The property test drives the manager the way the scheduler does
and checks, after every operation, the invariants that make the prefix cache safe:
ref counts match the holders, the free list holds exactly the unreferenced blocks, the
hash map and the blocks agree, and a cached block holds the K/V its hash names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from asyncllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import BlockHash, BlockHasher, hash_block_tokens
from asyncllm.core.request import Request
from asyncllm.sampling_params import SamplingParams


def ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def only_group(blocks: tuple[list[KVCacheBlock], ...] | None) -> list[KVCacheBlock]:
    """A one-group manager's blocks (allocate_slots, get_computed_blocks, get_blocks)."""
    assert blocks is not None and len(blocks) <= 1
    return blocks[0] if blocks else []


def block_ids(kv: KVCacheManager, rid: str) -> list[int]:
    """A one-group manager's block ids of a request."""
    per_group = kv.get_block_ids(rid)
    assert len(per_group) <= 1
    return per_group[0] if per_group else []


def key(i: int) -> BlockHash:
    """A distinct block hash for tests that do not care about the tokens behind it."""
    return hash_block_tokens(None, [i])


def cached_blocks(pool: BlockPool, n: int, first_key: int = 0) -> list[KVCacheBlock]:
    """n new blocks, registered in the prefix cache under key(first_key), key(first_key+1)..."""
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, [key(first_key + i) for i in range(n)], 0, n)
    return blocks


# -- FreeBlockQueue --------------------------------------------------------------------


def test_free_queue_hands_out_the_least_recently_appended_block_first() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks[:2])
    q.append(blocks[3])
    q.append(blocks[2])
    assert [q.popleft().block_id for _ in range(4)] == [0, 1, 3, 2]
    assert q.num_free_blocks == 0


def test_free_queue_popleft_on_an_empty_queue_raises() -> None:
    q = FreeBlockQueue([KVCacheBlock(0)])
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_removes_a_block_from_the_middle_and_relinks_its_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert q.num_free_blocks == 4
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[2])  # a removed block can come back, at the LRU end
    assert ids(q) == [0, 1, 3, 4, 2]


class _CountingBlock(KVCacheBlock):
    """A block that records which blocks anyone reads free-list links from."""

    __slots__ = ()
    read_from: set[int] = set()

    @property  # type: ignore[override]
    def next_free(self) -> KVCacheBlock | None:
        _CountingBlock.read_from.add(self.block_id)
        return KVCacheBlock.next_free.__get__(self)  # type: ignore[attr-defined]

    @next_free.setter
    def next_free(self, value: KVCacheBlock | None) -> None:
        KVCacheBlock.next_free.__set__(self, value)  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def prev_free(self) -> KVCacheBlock | None:
        _CountingBlock.read_from.add(self.block_id)
        return KVCacheBlock.prev_free.__get__(self)  # type: ignore[attr-defined]

    @prev_free.setter
    def prev_free(self, value: KVCacheBlock | None) -> None:
        KVCacheBlock.prev_free.__set__(self, value)  # type: ignore[attr-defined]


def test_free_queue_remove_is_constant_time_it_never_walks_the_list() -> None:
    """A cache hit takes its block out of the middle of a possibly huge free list: that
    must cost the same however long the list is: only the block itself is read."""
    blocks = [_CountingBlock(i) for i in range(1000)]
    q = FreeBlockQueue(blocks)
    _CountingBlock.read_from = set()
    q.remove(blocks[500])
    assert _CountingBlock.read_from == {500}
    assert q.num_free_blocks == 999 and blocks[499].next_free is blocks[501]


def test_free_queue_refuses_to_remove_an_absent_block_or_append_a_present_one() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError):
        q.remove(blocks[1])
    with pytest.raises(ValueError):
        q.append(blocks[0])
    assert ids(q) == [0]


# -- BlockPool -------------------------------------------------------------------------


def test_new_blocks_have_one_reference_and_leave_the_free_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert ids(pool.free_queue) == [3] and pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)


def test_asking_for_more_blocks_than_are_free_raises_and_takes_none() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_a_freed_cached_block_stays_findable_until_it_is_handed_out_again() -> None:
    """Freeing does not forget a block's hash: a later request with the same prefix can
    still hit it. Eviction happens only when get_new_blocks pops the block."""
    pool = BlockPool(4)
    a = cached_blocks(pool, 2)  # blocks 0 and 1 under key(0), key(1)
    pool.free_blocks(reversed(a))  # tail first: free queue is now 2, 3, 1, 0
    assert pool.get_cached_block(key(0)) is a[0] and pool.get_cached_block(key(1)) is a[1]

    plain = pool.get_new_blocks(2)  # the never-used blocks are older in the LRU order
    assert ids(plain) == [2, 3]
    assert pool.get_cached_block(key(0)) is a[0] and pool.get_cached_block(key(1)) is a[1]

    (evicted,) = pool.get_new_blocks(1)  # no plain free block left: evict the LRU one
    assert evicted is a[1]  # the request's tail was freed first, so it goes first
    assert evicted.block_hash is None and pool.get_cached_block(key(1)) is None
    assert pool.get_cached_block(key(0)) is a[0]  # the prefix survives longest


def test_eviction_follows_one_lru_order_for_cached_and_plain_blocks() -> None:
    """There is a single free list: a plain block freed after a cached one is handed out
    after it. "Cached blocks are evicted last" holds only for blocks freed earlier."""
    pool = BlockPool(3)
    (cached,) = cached_blocks(pool, 1)
    (plain,) = pool.get_new_blocks(1)
    pool.free_blocks([cached])
    pool.free_blocks([plain])  # free queue: 2 (never used), cached, plain
    assert pool.get_new_blocks(2) == [pool.blocks[2], cached]
    assert pool.get_cached_block(key(0)) is None


def test_touching_a_cached_free_block_takes_it_off_the_free_queue() -> None:
    """A cache hit on a free block makes it in use again: it must not be handed out."""
    pool = BlockPool(3)
    (b,) = cached_blocks(pool, 1)
    pool.free_blocks([b])
    assert b in list(pool.free_queue)
    pool.touch([b])
    assert b.ref_cnt == 1
    assert b not in list(pool.free_queue) and pool.num_free_blocks == 2
    assert b not in pool.get_new_blocks(2)
    assert pool.get_cached_block(key(0)) is b


def test_touching_a_block_in_use_only_adds_a_reference() -> None:
    pool = BlockPool(2)
    (b,) = cached_blocks(pool, 1)
    pool.touch([b])  # a second request shares it
    assert b.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b not in list(pool.free_queue)
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and list(pool.free_queue)[-1] is b


def test_freed_blocks_join_the_free_queue_in_the_order_given() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])
    assert ids(pool.free_queue) == [1, 2, 0]


def test_freeing_a_block_twice_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2


def test_reset_prefix_cache_is_refused_while_any_block_is_in_use() -> None:
    pool = BlockPool(3)
    a = cached_blocks(pool, 2)
    pool.free_blocks(a[:1])  # one cached block free, one still in use
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(key(0)) is a[0]  # nothing was forgotten
    pool.free_blocks(a[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)


def test_the_same_content_cached_twice_keeps_the_first_block() -> None:
    """Two requests may compute the same block in one step; the second copy stays plain
    (findable only once, freed like any plain block)."""
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [key(0)], 0, 1)
    pool.cache_full_blocks([second], [key(0)], 0, 1)
    assert pool.get_cached_block(key(0)) is first
    assert second.block_hash is None


def test_a_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


# -- KVCacheManager --------------------------------------------------------------------


def make_request(rid: str, tokens: list[int], block_size: int, **params: object) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_id=None,
        max_tokens=1000,
        block_hasher=BlockHasher(block_size),
    )


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request: cache lookup, then slots for the
    rest of the prompt. Returns the cache hit in tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit


def test_a_cache_hit_never_covers_the_last_prompt_token() -> None:
    """The last position's logits are needed to sample, so it is always recomputed: an
    identical prompt of exactly two blocks hits only the first block."""
    kv = KVCacheManager(8, 4, 64)
    tokens = list(range(8))
    assert admit(kv, make_request("a", tokens, 4)) == 0
    assert admit(kv, make_request("b", tokens, 4)) == 4
    assert admit(kv, make_request("c", tokens + [9], 4)) == 8


def test_prompt_logprobs_disable_cache_hits() -> None:
    """Prompt logprobs need every prompt position computed."""
    kv = KVCacheManager(8, 4, 64)
    tokens = list(range(9))
    admit(kv, make_request("a", tokens, 4))
    assert admit(kv, make_request("b", tokens, 4, prompt_logprobs=1)) == 0


def test_allocate_slots_that_do_not_fit_change_nothing() -> None:
    kv = KVCacheManager(2, 4, 64)
    req = make_request("a", list(range(9)), 4)  # 3 blocks needed, 2 exist
    assert kv.allocate_slots(req, 9) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("a") == []


def test_allocate_slots_returns_only_the_blocks_it_took_from_the_free_queue() -> None:
    """The other two outcomes of allocate_slots: [] when the blocks held have room, else
    the new blocks, appended after any cache hits. Hits are not in the returned list
    (the runner learns them from get_block_ids), though they are taken."""
    kv = KVCacheManager(8, 4, 64)
    a = make_request("a", list(range(10)), 4)
    first = only_group(kv.allocate_slots(a, 6))  # tokens 0..5: two blocks
    assert len(first) == 2 and ids(first) == block_ids(kv, "a")
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 2) == ()  # tokens 6..7 fit in the second block
    a.num_computed_tokens = 8
    more = only_group(kv.allocate_slots(a, 2))  # tokens 8..9 need a third
    assert ids(more) == block_ids(kv, "a")[2:] and len(more) == 1
    a.num_computed_tokens = 10

    b = make_request("b", list(range(10)), 4)
    found, num_hit = kv.get_computed_blocks(b)
    hits = only_group(found)
    assert num_hit == 8 and ids(hits) == block_ids(kv, "a")[:2]
    new = only_group(kv.allocate_slots(b, 2, num_hit, found))
    assert len(new) == 1 and new[0] not in hits
    assert block_ids(kv, "b") == ids(hits) + ids(new)
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    assert kv.num_free_blocks == 8 - 4


def test_free_releases_a_requests_blocks_tail_first() -> None:
    """So the request's prefix, the part other requests are likeliest to share, is the
    last of its blocks to be evicted."""
    kv = KVCacheManager(4, 4, 64)
    a = make_request("a", list(range(12)), 4)
    admit(kv, a)
    held = block_ids(kv, "a")
    kv.free(a)
    assert ids(kv.pool.free_queue) == [3] + held[::-1]
    assert all(kv.pool.get_cached_block(h) is not None for h in a.block_hashes)


def test_without_prefix_caching_no_block_is_registered_or_hit() -> None:
    kv = KVCacheManager(8, 4, 64, enable_caching=False)
    tokens = list(range(9))
    assert admit(kv, make_request("a", tokens, 4)) == 0
    assert admit(kv, make_request("b", tokens, 4)) == 0
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.stats.queries == 0


# -- property test ---------------------------------------------------------------------

VOCAB = 3  # few distinct tokens, so prompts share prefixes and the cache gets hits
MAX_LIVE = 6

_ops = st.one_of(
    # a new request: its prompt and the size of its first prefill chunk
    st.tuples(
        st.just("add"),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
        st.integers(1, 24),
    ),
    # one scheduler step for a live request: the rest of its prefill in chunks, or (once
    # everything is computed) one sampled token and one more slot
    st.tuples(st.just("step"), st.integers(0, MAX_LIVE - 1), st.integers(1, 8)),
    st.tuples(st.just("free"), st.integers(0, MAX_LIVE - 1), st.just(0)),
)


def assert_pool_invariants(pool: BlockPool) -> None:
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    # Walk the queue both ways: it holds exactly the blocks nobody references.
    walked = list(pool.free_queue)
    assert len(walked) == len({id(b) for b in walked}) == pool.num_free_blocks
    for prev, nxt in zip(walked, walked[1:]):
        assert nxt.prev_free is prev
    assert {b.block_id for b in walked} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    held = sum(b.ref_cnt > 0 for b in pool.blocks if b is not pool.null_block)
    assert pool.num_free_blocks + held == pool.num_blocks
    if pool.null_block is not None:  # never handed out, freed or registered
        assert pool.null_block.ref_cnt == 1 and pool.null_block.block_hash is None
    # The hash map and the blocks agree, both ways.
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached.get(b.block_hash) is b
    for h, b in pool.cached.items():
        assert b.block_hash == h


def chain_hash(tokens: tuple[int, ...], block_size: int) -> BlockHash | None:
    parent = None
    for i in range(0, len(tokens), block_size):
        parent = hash_block_tokens(parent, tokens[i : i + block_size])
    return parent


class SimulatedKV:
    """What the model would have written: each slot holds the whole token prefix up to
    its position (the K/V of a position depends on every token before it)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[tuple[int, ...] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]

    def write(self, kv: KVCacheManager, req: Request, start: int, end: int) -> None:
        held = block_ids(kv, req.request_id)
        for p in range(start, end):
            self.slots[held[p // self.block_size]][p % self.block_size] = tuple(
                req.all_token_ids[: p + 1]
            )

    def assert_holds(self, kv: KVCacheManager, req: Request) -> None:
        """Every computed position of the request reads its own prefix's K/V."""
        held = block_ids(kv, req.request_id)
        for p in range(req.num_computed_tokens):
            got = self.slots[held[p // self.block_size]][p % self.block_size]
            assert got == tuple(req.all_token_ids[: p + 1]), (req, p)

    def assert_cached_blocks_hold_their_hash(self, pool: BlockPool) -> None:
        for b in pool.cached.values():
            last = self.slots[b.block_id][-1]
            assert last is not None and chain_hash(last, self.block_size) == b.block_hash


def assert_manager_invariants(kv: KVCacheManager, live: list[Request], sim: SimulatedKV) -> None:
    assert_pool_invariants(kv.pool)
    holders: Counter[int] = Counter()
    for req in live:
        blocks = only_group(kv.coordinator.get_blocks(req.request_id))
        assert all(b.ref_cnt >= 1 for b in blocks)
        assert len(blocks) == -(-req.num_computed_tokens // kv.block_size)
        holders.update(b.block_id for b in blocks)
        sim.assert_holds(kv, req)
    # A block's ref count is exactly the number of live requests holding it.
    assert holders == Counter({b.block_id: b.ref_cnt for b in kv.pool.blocks if b.ref_cnt})
    sim.assert_cached_blocks_hold_their_hash(kv.pool)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(4, 16),
    ops=st.lists(_ops, min_size=10, max_size=60),
)
def test_kv_cache_manager_keeps_its_invariants_under_random_operations(
    block_size: int, num_blocks: int, ops: list[tuple[str, object, int]]
) -> None:
    max_model_len = 40
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=True)
    sim = SimulatedKV(num_blocks, block_size)
    live: list[Request] = []
    for n, (op, arg, size) in enumerate(ops):
        if op == "add":
            assert isinstance(arg, list)
            req = make_request(f"r{n}", arg, block_size)
            found, num_hit = kv.get_computed_blocks(req)
            hits = only_group(found)
            # A hit is the request's own first blocks, whole, never the last token, and
            # the longest one: the next block of the request is not cached.
            assert [b.block_hash for b in hits] == req.block_hashes[: len(hits)]
            assert num_hit == len(hits) * block_size < req.num_tokens
            if hits:
                event("prefix cache hit")
            if len(hits) < (req.num_tokens - 1) // block_size:
                assert kv.pool.get_cached_block(req.block_hashes[len(hits)]) is None
            free_before = kv.num_free_blocks
            chunk = min(size, req.num_tokens - num_hit)
            if kv.allocate_slots(req, chunk, num_hit, found) is None:
                event("admission refused")
                assert kv.num_free_blocks == free_before and kv.get_block_ids(req.request_id) == []
            else:
                req.num_computed_tokens = num_hit + chunk
                sim.write(kv, req, num_hit, req.num_computed_tokens)
                live.append(req)
        elif op == "step" and live:
            assert isinstance(arg, int)
            req = live[arg % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                if req.num_tokens >= max_model_len:
                    continue
                req.append_output_token_ids(req.num_tokens % VOCAB)  # "sampled"
            chunk = min(size, req.num_tokens - req.num_computed_tokens)
            held = kv.get_block_ids(req.request_id)
            if kv.allocate_slots(req, chunk) is None:  # the scheduler would preempt
                event("step refused")
                assert kv.get_block_ids(req.request_id) == held
            else:
                start = req.num_computed_tokens
                req.num_computed_tokens += chunk
                sim.write(kv, req, start, req.num_computed_tokens)
        elif op == "free" and live:
            assert isinstance(arg, int)
            req = live.pop(arg % len(live))
            kv.free(req)
            assert kv.get_block_ids(req.request_id) == []
        assert_manager_invariants(kv, live, sim)

    for req in live:
        kv.free(req)
    assert_pool_invariants(kv.pool)
    assert kv.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
