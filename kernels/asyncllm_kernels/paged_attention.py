"""Paged attention for a flat batch of query chunks, in one launch.

The batch is a list of chunks, one per sequence: a decode is a chunk of one token, a
prefill chunk may follow tokens already in the cache. Keys and values are read from a
paged cache `[num_blocks, block_size, num_kv_heads, head_size]` through each
sequence's block table.

Work split. A program owns one *query tile* of one KV head: `BLOCK_Q` consecutive
tokens of one sequence times the `GROUP` query heads that share the KV head, flattened
into `BLOCK_M = BLOCK_Q * GROUP` (padded) rows, so every group size (1, 2, 3, 4, 8, ...)
feeds the tensor cores and each K/V tile is loaded once for the whole group. It walks
the keys in tiles of `BLOCK_N` (gathered from the block table), with an online softmax
in float32 (base 2). Tiles that are fully visible to every row skip the mask.

The tile grid has `num_tokens // BLOCK_Q + num_seqs` rows, an upper bound on the tiles
any batch of that size needs; a program finds its sequence by binary search over
`query_start_loc` and exits when its tile is past the end of its chunk. Launches of
decode-shaped tiles (decodes, short chunks), where every chunk fits in one tile, have
one row per sequence instead and skip the search (at batch 256 it was eight dependent
loads before a program's first key). For small
batches the keys of each sequence are also split into `NUM_SPLITS` parts (flash-decoding)
whose partial results a second kernel merges; splits serve batches whose every chunk
fits in one query tile (decodes, and short chunks such as speculative verification's
1 + k tokens). The grid, the split count and the tile
sizes depend only on the tensor shapes (the padded batch of a CUDA-graph bucket) and
on whether the batch is decode-only; per-step values (lengths, positions, tables) are
read from device memory, so a captured launch stays right when replayed with new ones.

The plain-torch reference is `paged_attention_ref` in reference.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncllm_kernels import pdl

LOG2E = tl.constexpr(1.4426950408889634)
# A decode split past the 16th is used once every split has this many key tiles.
SPLIT_TILES = 8
# A batch whose chunks have at most this many tokens (a speculative verification's
# 1 + k, short prompts beside decodes) runs in one launch of decode-shaped tiles, each
# chunk in one query tile, with the decodes' KV split (`short_launch`).
SHORT_QUERY = 8
SHORT_ROWS = 64  # ... where a tile of SHORT_QUERY tokens has at most this many rows


@triton.jit
def _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest sequence i with query_start[i] // BLOCK_Q + i <= tile."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_tiles(
    acc,
    m,
    l_sum,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    table_ptr,
    kv_begin,
    kv_end,
    tile_lo,
    tile_hi,
    qk_scale,
    soft_cap,
    window,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    d,
    d_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    K_ROWS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
):
    n = tl.arange(0, BLOCK_N)
    for j in range(tile_lo, tile_hi):
        kpos = kv_begin + j * BLOCK_N + n
        if MASKED:
            k_ok = kpos < kv_end
            block = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=k_ok, other=0)
        else:
            block = tl.load(table_ptr + kpos // BLOCK_SIZE)
        slot = kpos % BLOCK_SIZE
        k_off = block.to(tl.int64) * stride_kb + slot * stride_ks
        v_off = block.to(tl.int64) * stride_vb + slot * stride_vs
        if MASKED or HEAD != HEAD_PAD:
            if MASKED:
                kt_mask = k_ok[None, :] & d_ok[:, None]
                v_mask = k_ok[:, None] & d_ok[None, :]
            else:
                kt_mask = d_ok[:, None]
                v_mask = d_ok[None, :]
            if K_ROWS:  # (keys as rows, as V: transposed for the dot)
                kt = tl.trans(
                    tl.load(k_ptr + k_off[:, None] + d[None, :], mask=tl.trans(kt_mask), other=0.0)
                )
            else:
                kt = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=kt_mask, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=v_mask, other=0.0)
        else:
            if K_ROWS:
                kt = tl.trans(tl.load(k_ptr + k_off[:, None] + d[None, :]))
            else:
                kt = tl.load(k_ptr + k_off[None, :] + d[:, None])
            v = tl.load(v_ptr + v_off[:, None] + d[None, :])
        s = tl.dot(q, kt, input_precision=PRECISION)
        if USE_CAP:
            x = s * (qk_scale / soft_cap)
            s = soft_cap * LOG2E * (2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0)  # cap * tanh(x)
            s_scale = 1.0
        else:
            s_scale = qk_scale * LOG2E  # folded into the exponent's FMA below
        if MASKED:
            visible = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1) * s_scale)
        if LAZY_RESCALE:
            # Rescale only when some row's maximum grew past 2^8 of the one the sums are
            # kept at (or a row saw its first key): until then p stays below 2^8 and the
            # float32 sums hold it; acc and l_sum share the stale maximum.
            grow = tl.where(m_new == m, 0.0, m_new - tl.maximum(m, -1e30))  # (no inf - inf)
            if tl.max(grow, axis=0) > 8.0:
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_ref)
                l_sum = l_sum * alpha
                acc = acc * alpha[:, None]
                m = m_new
            m_ref = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s * s_scale - m_ref[:, None])
            l_sum = l_sum + tl.sum(p, axis=1)
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            alpha = tl.exp2(m - m_ref)
            p = tl.exp2(s * s_scale - m_ref[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
    return acc, m, l_sum


@triton.jit(do_not_specialize=["num_seqs", "split_q"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_ptr,
    stat_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    num_seqs,
    split_q,
    qk_scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    SEQ_FILTER: tl.constexpr,
    K_ROWS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.begin(PDL)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TILE:
        # Every chunk fits in one tile (decodes, short chunks): one program row per
        # sequence, found without a search.
        seq = tl.program_id(0)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        local = 0
        if q_len == 0:
            return  # a padding sequence
    else:
        # Last tiles first: in a causal chunk they see the most keys (longest work first).
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_seq(query_start_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        local = tile - (q_start // BLOCK_Q + seq)
        if local * BLOCK_Q >= q_len:
            return
    if SEQ_FILTER == 1 and q_len != 1:
        return  # a longer chunk: the other launch's
    if SEQ_FILTER == 2 and q_len == 1:
        return  # a decode: the other launch's
    context = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // GROUP  # token index within the chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD
    q_pos = context + tok

    # Keys this tile may see: up to its last token, from its first token's window.
    first_pos = context + local * BLOCK_Q
    kv_end = context + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    num_tiles = tl.cdiv(kv_end - kv_begin, BLOCK_N)
    if USE_WINDOW:
        num_full = 0
    else:
        num_full = (first_pos + 1 - kv_begin) // BLOCK_N  # every row sees all of them
    tile_lo = 0
    tile_hi = num_tiles
    if NUM_SPLITS > 1:
        # Up to 16 splits at any length; past that, one more per SPLIT_TILES tiles, so a
        # long context fills the grid while a short one does not pay for the merge.
        base = tl.minimum(NUM_SPLITS, 16)
        active = tl.minimum(tl.maximum(num_tiles // SPLIT_TILES, base), NUM_SPLITS)
        per_split = tl.cdiv(num_tiles, active)
        tile_lo = tl.minimum(split * per_split, num_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        if tile_lo >= tile_hi:  # an unused split: empty stats, no partial (not read)
            at = ((seq.to(tl.int64) * split_q + tok) * NUM_HEADS + head) * NUM_SPLITS + split
            tl.store(stat_ptr + at * 2, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(stat_ptr + at * 2 + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    acc, m, l_sum = _attend_tiles(
        acc, m, l_sum, q, q_pos, k_base, v_base, table, kv_begin, kv_end,
        tile_lo, tl.minimum(tile_hi, num_full), qk_scale, soft_cap, window,
        stride_kb, stride_ks, stride_vb, stride_vs, d, d_ok,
        BLOCK_N, BLOCK_SIZE, HEAD, HEAD_PAD, False, USE_CAP, USE_WINDOW, PRECISION,
        K_ROWS, LAZY_RESCALE,
    )  # fmt: skip
    acc, m, l_sum = _attend_tiles(
        acc, m, l_sum, q, q_pos, k_base, v_base, table, kv_begin, kv_end,
        tl.maximum(tile_lo, num_full), tile_hi, qk_scale, soft_cap, window,
        stride_kb, stride_ks, stride_vb, stride_vs, d, d_ok,
        BLOCK_N, BLOCK_SIZE, HEAD, HEAD_PAD, True, USE_CAP, USE_WINDOW, PRECISION,
        K_ROWS, LAZY_RESCALE,
    )  # fmt: skip

    token = (q_start + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        o_rows = token * stride_ot + head * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:  # splits serve chunks of one tile (at most split_q tokens): partials per token
        at = ((seq.to(tl.int64) * split_q + tok) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_ptr + at[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stat_ptr + at * 2, m, mask=row_ok)
        tl.store(stat_ptr + at * 2 + 1, l_sum, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_ptr,
    stat_ptr,
    query_start_ptr,
    split_q,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, head): merges the splits of each token of a chunk of
    1 to `split_q` tokens; other sequences (padding, or longer chunks of a mixed batch)
    are not this launch's."""
    pdl.begin(PDL)
    seq = tl.program_id(0)
    h = tl.program_id(1)
    first_token = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - first_token
    if q_len < 1 or q_len > split_q:
        return
    d = tl.arange(0, HEAD_PAD)
    every = tl.arange(0, NUM_SPLITS)
    for t in range(0, q_len):
        # The used splits are a prefix (an unused one has an empty stat): read every
        # stat once for the maximum and the prefix length, then only the used partials,
        # in chunks of up to 16 splits. (A split past a token's position, in a causal
        # chunk, has an empty stat for that token too: its weight is 0.)
        base = ((seq.to(tl.int64) * split_q + t) * NUM_HEADS + h) * NUM_SPLITS
        m_every = tl.load(stat_ptr + (base + every) * 2)
        m_max = tl.max(m_every, axis=0)
        used = tl.max(tl.where(m_every == float("-inf"), 0, every + 1), axis=0)
        acc = tl.zeros([HEAD_PAD], tl.float32)
        denom = 0.0
        for first in range(0, used, CHUNK):
            at = base + first + tl.arange(0, CHUNK)
            m = tl.load(stat_ptr + at * 2)
            w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
            denom += tl.sum(tl.load(stat_ptr + at * 2 + 1) * w, axis=0)
            part = tl.load(
                part_ptr + at[:, None] * HEAD_PAD + d[None, :], mask=(w > 0)[:, None], other=0.0
            )
            acc += tl.sum(part * w[:, None], axis=0)
        out = acc / denom
        token = (first_token + t).to(tl.int64)
        tl.store(
            out_ptr + token * stride_ot + h * stride_oh + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD,
        )


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch shape, chosen from shapes ahead of time (no autotuning)."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    k_rows: bool = False  # load key tiles as rows (transposed for the dot), not columns
    lazy_rescale: bool = False  # rescale the running sums only when a maximum grew past 2^8


def short_launch(max_query_len: int, group: int) -> bool:
    """Whether a batch whose longest chunk has `max_query_len` tokens runs in one launch
    of decode-shaped tiles (`choose_config(..., decode_only=True, query_len=...)`): one-
    token decodes always; chunks of up to SHORT_QUERY tokens where such a tile has at
    most SHORT_ROWS rows (so decodes beside them keep small tiles)."""
    return max_query_len <= 1 or (
        max_query_len <= SHORT_QUERY and SHORT_QUERY * group <= SHORT_ROWS
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    decode_only: bool,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    num_splits: int | None = None,
    query_len: int = 1,
) -> AttentionConfig:
    """Decode-only batches (every chunk one token; with `query_len` > 1, every chunk at
    most that many tokens, as `short_launch` allows: tiles of SHORT_QUERY tokens x the
    group, padded) use 16-row tiles, 64-key tiles (head
    128), 4 warps and 2 stages, the fastest at every batch swept (1-256, contexts 128 to
    1.5k: at batch 64-256 and 0.5-1.5k keys 0.82-1.0 of the KV-read floor, against
    0.65-0.91 for 128-key tiles, 8 warps, 3 stages); when the batch gives fewer
    (sequence, KV head) programs than the GPU has SMs, each sequence's keys are also
    split so that about four programs run per SM (at most 64 splits): there a step's
    attention is bound by latency, not bandwidth. Past 16 splits, a split is used only
    once each has `SPLIT_TILES` key tiles (batch 1 at 128k keys: 64 splits; at 4k: 16),
    the rest exit at once, so short contexts keep the 16-split timings. Other batches use large tiles for the
    tensor cores. Depends only on the (padded) batch shape and dtype. Float32 (IEEE dots, for reference
    checks) gets smaller tiles to fit in shared memory and registers. The 16-bit
    choices come from the H200 sweeps in benchmarks/kernels/bench_attention.py and
    benchmarks/kernels/sweep_decode.py (and its --large)."""
    head_pad = triton.next_power_of_2(head_size)
    wide = dtype == torch.float32
    if decode_only:
        if not short_launch(query_len, group):
            raise ValueError(
                f"query_len {query_len} with group {group} is not a short launch's "
                f"(chunks of up to {SHORT_QUERY} tokens, {SHORT_ROWS} rows a tile)"
            )
        rows = group if query_len == 1 else SHORT_QUERY * group
        block_m = max(16, triton.next_power_of_2(rows))
        if device.type == "cuda":
            sms = _num_sms(device.index or 0)
            target = 4 * sms
        else:  # the interpreter, in tests: a small "GPU" keeps the cases small
            sms = target = 8
        programs = max(num_seqs * num_kv_heads, 1)
        block_n = (64 if head_pad <= 128 else 32) // (2 if wide else 1)
        if programs < sms and num_splits is None:
            num_splits = min(1 << ((target // programs).bit_length() - 1), 64)
        return AttentionConfig(block_m, block_n, num_splits or 1, num_warps=4, num_stages=2)
    if wide:
        block_m = max(64 if head_pad <= 128 else 32, triton.next_power_of_2(group))
        return AttentionConfig(block_m, 32, num_splits or 1, num_warps=8, num_stages=2)
    block_m = max(128 if head_pad <= 128 else 64, triton.next_power_of_2(group))
    block_n = 128 if head_pad <= 128 else 64
    return AttentionConfig(block_m, block_n, num_splits or 1, num_warps=8, num_stages=3)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    has_decodes: bool = False,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    rows: str = "all",
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_table: [S, max_blocks];
    seq_lens: [S] (context + chunk); query_start_loc: [S + 1]. Returns [T, Hq, D].

    The caches must already hold this step's K/V. Tokens past `query_start_loc[S]` (graph
    padding) are not written; padded sequences have a chunk of length 0. `max_query_len`
    picks the tile shape (1: the decode-only shape). A batch that mixes decodes with
    longer chunks (`has_decodes` and `max_query_len > 1`) gets two launches over the same
    metadata, each skipping the other's sequences, so decodes do not pay for prefill-sized
    tiles. `rows`: "decodes" or "chunks" computes only the one-token sequences, or only
    the longer ones (leaving the other rows of `out` as they were): for a backend that
    gives the chunks to another kernel. Float32 inputs use IEEE float32 dots."""
    if rows not in ("all", "decodes", "chunks"):
        raise ValueError(f"rows must be 'all', 'decodes' or 'chunks', got {rows!r}")
    T, Hq, D = q.shape
    _, _, Hkv, _ = key_cache.shape
    if Hq % Hkv:
        raise ValueError(f"num_heads {Hq} is not a multiple of num_kv_heads {Hkv}")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, contiguous in the last dim")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive (or None), got {soft_cap}")
    group = Hq // Hkv
    if config is not None:
        splits = config.num_splits
        if splits < 1 or splits & (splits - 1):
            raise ValueError(f"num_splits must be a power of two, got {splits}")
    S = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    args = (q, key_cache, value_cache, out, block_table, seq_lens, query_start_loc)
    opts = (scale, sliding_window, soft_cap)
    max_q = max(max_query_len, 1)
    short = short_launch(max_q, group)  # every chunk in one decode-shaped tile
    if rows != "all":
        decodes = rows == "decodes"
        cfg = config or choose_config(S, Hkv, group, D, decodes, q.device, q.dtype)
        _launch(*args, *opts, cfg, 1 if decodes else 2, 1 if decodes else max_q, decodes)
    elif short or config is not None or not has_decodes:
        cfg = config or choose_config(S, Hkv, group, D, short, q.device, q.dtype, query_len=max_q)
        # (decode-shaped tiles hold whole chunks; prefill tiles keep the search, as the
        # launches the warm-up and the profile run compile)
        one_tile = max_q <= cfg.block_m // group and (short or cfg.num_splits > 1)
        _launch(*args, *opts, cfg, 0, max_q, one_tile)
    else:
        cfg = choose_config(S, Hkv, group, D, True, q.device, q.dtype)
        _launch(*args, *opts, cfg, 1, 1, True)
        cfg = choose_config(S, Hkv, group, D, False, q.device, q.dtype)
        _launch(*args, *opts, cfg, 2, max_q, False)
    return out


def _launch(
    q, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
    scale, sliding_window, soft_cap, cfg: AttentionConfig, seq_filter: int, max_q: int,
    one_tile: bool,
) -> None:  # fmt: skip
    """`max_q`: the most tokens a chunk this launch serves has. `one_tile`: each fits in
    one query tile, and the grid has one row per sequence (no search for it); a KV
    split needs that."""
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = key_cache.shape
    group = Hq // Hkv
    S = seq_lens.shape[0]
    head_pad = triton.next_power_of_2(D)
    block_q = cfg.block_m // group
    if block_q < 1:
        raise ValueError(f"block_m {cfg.block_m} is smaller than the group size {group}")
    if cfg.num_splits > 1 and not one_tile:
        raise ValueError(
            f"a KV split needs every chunk in one query tile: chunks of up to {max_q} "
            f"tokens, {block_q} tokens per tile"
        )
    if cfg.num_splits > 1:  # (partials per sequence and token of its chunk)
        rows = S * max_q * Hq * cfg.num_splits
        part = torch.empty(rows * head_pad, device=q.device, dtype=torch.float32)
        stat = torch.empty(rows * 2, device=q.device, dtype=torch.float32)
    else:
        part = stat = out  # not read
    grid = (S if one_tile else T // block_q + S, Hkv, cfg.num_splits)
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        part,
        stat,
        block_table,
        seq_lens,
        query_start_loc,
        S,
        max_q,
        scale,
        soft_cap or 1.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=Hq,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        HEAD=D,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=cfg.num_splits,
        SPLIT_TILES=SPLIT_TILES,
        USE_CAP=soft_cap is not None,
        USE_WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SEQ_FILTER=seq_filter,
        K_ROWS=cfg.k_rows,
        LAZY_RESCALE=cfg.lazy_rescale,
        ONE_TILE=one_tile,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.options(q),
    )
    if cfg.num_splits > 1:
        _merge_splits_kernel[(S, Hq)](
            out,
            part,
            stat,
            query_start_loc,
            max_q,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=Hq,
            HEAD=D,
            HEAD_PAD=head_pad,
            NUM_SPLITS=cfg.num_splits,
            CHUNK=min(cfg.num_splits, 16),
            num_warps=8 if min(cfg.num_splits, 16) * head_pad >= 8192 else 4,
            **pdl.options(q),
        )
