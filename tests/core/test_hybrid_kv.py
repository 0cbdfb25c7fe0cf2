"""The hybrid KV cache: groups per attention type (model/kv_groups.py), windowed groups
that free the blocks out of their window, and prefix-cache hits found per group and
cut to one length. A random-operation test checks, against a simulation of what each
group's layers wrote, that every position a query reads holds its own prefix's K/V,
with and without cache hits."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request import Request
from asyncllm.model.kv_groups import KVCacheGroup, KVCacheLayout, kv_cache_layout
from tests.core.test_block_pool import assert_pool_invariants, make_request


def config(n: int, window: int | None = 8, **kw: object) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=n, sliding_window=window, **kw)


def test_layouts_of_published_patterns() -> None:
    # Gemma 2: alternating; one group per type.
    types = ["sliding_attention", "full_attention"] * 13
    g2 = kv_cache_layout(config(26, 4096, layer_types=types))
    assert [(g.sliding_window, g.layers) for g in g2.groups] == [
        (None, tuple(range(1, 26, 2))),
        (4096, tuple(range(0, 26, 2))),
    ]
    assert g2.group_size == 13 and g2.hybrid
    # Gemma 3 1B: five local layers per global one; groups of four layers.
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    g3 = kv_cache_layout(config(26, 512, layer_types=types))
    assert g3.group_size == 4 and len(g3.groups) == 7
    assert g3.groups[0] == KVCacheGroup(None, (5, 11, 17, 23))
    assert [len(g.layers) for g in g3.groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert g3.tensor_of(23) == (0, 3) and g3.tensor_of(0) == (1, 0) and g3.tensor_of(25) == (6, 1)
    # Mistral: every layer windowed; Qwen2 without use_sliding_window: none.
    assert kv_cache_layout(config(4)).groups == (KVCacheGroup(8, (0, 1, 2, 3)),)
    plain = kv_cache_layout(config(4, use_sliding_window=False))
    assert plain.groups == (KVCacheGroup(None, (0, 1, 2, 3)),) and not plain.hybrid
    # Turned off: one group of every layer, whatever the windows.
    off = kv_cache_layout(config(26, 512, layer_types=types), hybrid=False)
    assert off.groups == (KVCacheGroup(None, tuple(range(26))),) and off.group_size == 26


def test_blocks_per_request_counts_a_window_once_it_is_full() -> None:
    layout = KVCacheLayout((KVCacheGroup(None, (0,)), KVCacheGroup(32, (1,))), 1)
    assert layout.blocks_per_request(16, 16) == 1 + 1
    assert layout.blocks_per_request(1024, 16) == 64 + (2 + 1)


HYBRID = KVCacheLayout((KVCacheGroup(None, (0,)), KVCacheGroup(10, (1,))), 1)


def windowed_manager(num_blocks: int, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, 512, enable_caching=caching, layout=HYBRID)


def run_to_end(kv: KVCacheManager, req: Request, chunk: int, decode: int) -> list[tuple[int, int]]:
    """Prefills `req` in chunks, then decodes `decode` tokens; returns, at each step, the
    tokens computed in it and the windowed group's blocks held during it."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        held.append((n, kv.num_held_blocks()[1]))
        req.num_computed_tokens += n
    for t in range(decode):
        req.append_output_token_ids(t % 7)
        assert kv.allocate_slots(req, 1) is not None
        held.append((1, kv.num_held_blocks()[1]))
        req.num_computed_tokens += 1
    return held


def test_a_windowed_group_holds_its_window_and_every_block_returns() -> None:
    """A request of 8x the window: between decode steps at most ceil(window / block) + 1
    blocks in the windowed group, during a chunk of C tokens at most
    ceil((window - 1 + C) / block) + 1; the full group holds every block; at the end
    every block is free again."""
    bs, window = 4, 10
    kv = windowed_manager(100, bs)
    req = make_request("a", [i % 5 for i in range(60)], bs)
    held = run_to_end(kv, req, chunk=7, decode=20)
    for n, blocks in held:
        assert blocks <= -(-(window - 1 + n) // bs) + 1, (n, blocks)
    assert max(b for n, b in held if n == 1) <= -(-window // bs) + 1
    assert kv.num_held_blocks()[0] == -(-req.num_computed_tokens // bs)
    kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks == 99 and kv.num_held_blocks() == [0, 0]
    assert_pool_invariants(kv.pool)


def test_prefix_hits_are_cut_to_what_every_group_serves() -> None:
    """The full group's hit is a prefix; the windowed group needs the blocks right
    before the hit's end. A window block evicted shortens the hit to a length where the
    window's blocks are all still cached; blocks before the window are the null block."""
    bs = 4
    kv = windowed_manager(100, bs)
    tokens = list(range(40))
    a = make_request("a", tokens, bs)
    run_to_end(kv, a, chunk=40, decode=0)
    kv.free(a)
    b = make_request("b", tokens + [99], bs)
    (full, window), n = kv.get_computed_blocks(b)
    assert n == 40 and len(full) == len(window) == 10
    null = kv.pool.null_block
    assert window[:7] == [null] * 7 and null not in window[7:]  # tokens 31-39 read back
    # Evict the windowed group's block of tokens 32-35: the hit falls back to the
    # longest length whose window is intact (32: the query at 32 reads tokens 23-31).
    evicted = window[8]
    kv.pool.uncache([evicted])
    (full, window), n = kv.get_computed_blocks(b)
    assert n == 32 and len(full) == len(window) == 8
    assert window[:5] == [null] * 5 and null not in window[5:] and evicted not in window
    assert kv.allocate_slots(b, b.num_tokens - n, n, (full, window)) is not None
    b.num_computed_tokens = b.num_tokens
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


# -- random operations against a simulation of the groups' K/V ------------------------

_ops = st.lists(
    st.one_of(
        # a new request: a prefix of one shared text (so hits are common), its own tail,
        # and the size of its first prefill chunk
        st.tuples(
            st.just("add"),
            st.tuples(st.integers(0, 36), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
            st.integers(1, 24),
        ),
        st.tuples(st.just("step"), st.integers(0, 5), st.integers(1, 8)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    min_size=10,
    max_size=60,
)


SHARED = [(i * 7) % 5 for i in range(36)]


class SimulatedGroups:
    """What each group's layers would have written: a slot holds the token prefix up to
    its position (a K/V depends on every token before it)."""

    def __init__(self, num_blocks: int, block_size: int, num_groups: int) -> None:
        self.bs = block_size
        self.slots = [[[None] * block_size for _ in range(num_blocks)] for _ in range(num_groups)]

    def write(self, kv: KVCacheManager, req: Request, start: int, end: int) -> None:
        for g, ids in enumerate(kv.get_block_ids(req.request_id)):
            for p in range(start, end):
                self.slots[g][ids[p // self.bs]][p % self.bs] = tuple(req.all_token_ids[: p + 1])

    def assert_reads(self, kv: KVCacheManager, req: Request, window: int) -> None:
        """The keys the request's next query reads hold their own prefixes' K/V: every
        computed position in the full group, those in the window in the other."""
        p_next = req.num_computed_tokens
        for g, ids in enumerate(kv.get_block_ids(req.request_id)):
            lo = 0 if g == 0 else max(p_next - window + 1, 0)
            for p in range(lo, p_next):
                got = self.slots[g][ids[p // self.bs]][p % self.bs]
                assert got == tuple(req.all_token_ids[: p + 1]), (req, g, p)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(8, 24),
    caching=st.booleans(),
    ops=_ops,
)
def test_the_hybrid_manager_keeps_every_read_right_under_random_operations(
    block_size: int, num_blocks: int, caching: bool, ops: list[tuple[str, object, int]]
) -> None:
    window = HYBRID.groups[1].sliding_window
    assert window is not None
    kv = windowed_manager(num_blocks, block_size, caching)
    sim = SimulatedGroups(num_blocks, block_size, 2)
    live: list[Request] = []
    for n, (op, arg, size) in enumerate(ops):
        if op == "add":
            assert isinstance(arg, tuple)
            req = make_request(f"r{n}", SHARED[: arg[0]] + arg[1], block_size)
            hits, num_hit = kv.get_computed_blocks(req)
            if num_hit:
                event("prefix cache hit")
            chunk = min(size, req.num_tokens - num_hit)
            if kv.allocate_slots(req, chunk, num_hit, hits) is None:
                assert kv.get_block_ids(req.request_id) == []
                continue
            req.num_computed_tokens = num_hit
            sim.assert_reads(kv, req, window)  # (the hit's blocks)
            sim.write(kv, req, num_hit, num_hit + chunk)
            req.num_computed_tokens = num_hit + chunk
            live.append(req)
        elif op == "step" and live:
            assert isinstance(arg, int)
            req = live[arg % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                if req.num_tokens >= 60:
                    continue
                req.append_output_token_ids(req.num_tokens % 3)
            chunk = min(size, req.num_tokens - req.num_computed_tokens)
            if kv.allocate_slots(req, chunk) is None:
                event("step refused")
                continue
            start = req.num_computed_tokens
            sim.write(kv, req, start, start + chunk)
            req.num_computed_tokens += chunk
        elif op == "free" and live:
            assert isinstance(arg, int)
            kv.free(live.pop(arg % len(live)))
        assert_pool_invariants(kv.pool)
        for req in live:
            sim.assert_reads(kv, req, window)
            full, windowed = kv.coordinator.get_blocks(req.request_id)
            assert len(full) == len(windowed) == -(-req.num_computed_tokens // block_size)
    for req in live:
        kv.free(req)
    assert_pool_invariants(kv.pool)
    assert kv.num_free_blocks == num_blocks - 1 and kv.num_held_blocks() == [0, 0]
