"""One rank of the two-process checks of test_tensor_parallel.py.

Run as `python -m tests.distributed.tp_worker RANK WORLD INIT_METHOD OUT_DIR`. Every rank
builds the same full weights from fixed seeds, runs each check in `CHECKS` in order
(the sharded layer against plain torch on the full weights; the group API) and writes
`OUT_DIR/rank{RANK}.json` after each check: its name -> None, or the error it raised.
The first failing check ends the rank (exit 1): the other rank may be waiting in a
collective this one will never run, and the test kills it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncllm.distributed import parallel_state as ps
from asyncllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    cpu_packing_available,
)
from tests.distributed.ranks import run_checks

TP = 2
TOL = 1e-5
HIDDEN = 32
TOKENS = 7

CHECKS: list[tuple[str, Callable[[], None]]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append((fn.__name__, fn))
    return fn


def full(*shape: int, seed: int, scale: float = 0.1) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item() if ours.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


def rank() -> int:
    return ps.get_tp_group().rank_in_group


def cols(t: torch.Tensor, size: int, index: int | None = None) -> torch.Tensor:
    """The slice of the last dimension that rank `index` (default: this rank) holds."""
    i = rank() if index is None else index
    return t[..., i * size : (i + 1) * size]


def packed_too(*layers: torch.nn.Module) -> bool:
    """Packs the layers for the CPU (oneDNN) when this torch can; False if not."""
    if not cpu_packing_available():
        return False
    for layer in layers:
        layer.pack_for_cpu()  # type: ignore[operator]
    return True


# --- layers at TP = 2 ---------------------------------------------------------------
@check
def embedding_padded_vocab() -> None:
    vocab, dim = 1000, 16
    weight = full(vocab, dim, seed=1, scale=1.0)
    emb = VocabParallelEmbedding(vocab, dim)
    assert emb.num_embeddings_padded == 1024, emb.num_embeddings_padded
    assert tuple(emb.weight.shape) == (512, dim), tuple(emb.weight.shape)
    emb.weight.weight_loader(emb.weight, weight)  # type: ignore[attr-defined]
    if rank() == 1:  # the padding rows are zeros
        assert emb.weight[1000 - 512 :].abs().sum() == 0
    ids = torch.tensor([0, 1, 511, 512, 513, 998, 999, 500, 700, 3])
    close(emb(ids), F.embedding(ids, weight), "embedding")


@check
def embedding_and_head_small_vocab() -> None:
    # 10 tokens at TP 2: 128 padded rows, rank 1's shard is all padding.
    vocab, dim = 10, 16
    weight = full(vocab, dim, seed=2, scale=1.0)
    emb = VocabParallelEmbedding(vocab, dim)
    head = ParallelLMHead(vocab, dim)
    assert (emb.num_embeddings_padded, emb.shard_size) == (128, 64)
    emb.weight.weight_loader(emb.weight, weight)  # type: ignore[attr-defined]
    head.weight.weight_loader(head.weight, weight)  # type: ignore[attr-defined]
    ids = torch.arange(vocab)
    close(emb(ids), F.embedding(ids, weight), "embedding")
    h = full(TOKENS, dim, seed=3, scale=1.0)
    close(head(h), F.linear(h, weight), "LM head")


@check
def merged_gate_up() -> None:
    inter = 48
    gate, up = full(inter, HIDDEN, seed=10), full(inter, HIDDEN, seed=11)
    x = full(TOKENS, HIDDEN, seed=12, scale=1.0)
    layer = MergedColumnParallelLinear(HIDDEN, [inter, inter])
    assert tuple(layer.weight.shape) == (inter, HIDDEN)  # 2 x 48 / TP 2
    load = layer.weight.weight_loader  # type: ignore[attr-defined]
    load(layer.weight, gate, 0)
    load(layer.weight, up, 1)
    half = inter // TP
    ref = torch.cat([cols(F.linear(x, gate), half), cols(F.linear(x, up), half)], -1)
    close(layer(x), ref, "gate/up")
    # The parts already merged in one checkpoint tensor load the same shards.
    merged = MergedColumnParallelLinear(HIDDEN, [inter, inter])
    load(merged.weight, torch.cat([gate, up]))
    assert torch.equal(merged.weight, layer.weight), "merged checkpoint tensor"
    if packed_too(layer):
        close(layer(x), ref, "gate/up, packed")


def _check_qkv(num_heads: int, num_kv_heads: int, seed: int) -> None:
    d = 8
    hidden = num_heads * d
    q = full(num_heads * d, hidden, seed=seed)
    k = full(num_kv_heads * d, hidden, seed=seed + 1)
    v = full(num_kv_heads * d, hidden, seed=seed + 2)
    qb, kb, vb = (full(t.shape[0], seed=seed + 3 + i) for i, t in enumerate((q, k, v)))
    x = full(TOKENS, hidden, seed=seed + 9, scale=1.0)
    layer = QKVParallelLinear(hidden, d, num_heads, num_kv_heads, bias=True)
    heads, kv_heads = num_heads // TP, max(1, num_kv_heads // TP)
    assert (layer.num_heads, layer.num_kv_heads) == (heads, kv_heads)
    assert layer.bias is not None
    for shard, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
        layer.weight.weight_loader(layer.weight, w, shard)  # type: ignore[attr-defined]
        layer.bias.weight_loader(layer.bias, b, shard)  # type: ignore[attr-defined]
    kv_index = rank() * num_kv_heads // TP  # replicated: ranks share a head
    ref = torch.cat(
        [
            cols(F.linear(x, q, qb), heads * d),
            cols(F.linear(x, k, kb), kv_heads * d, kv_index),
            cols(F.linear(x, v, vb), kv_heads * d, kv_index),
        ],
        -1,
    )
    close(layer(x), ref, f"QKV {num_heads} heads, {num_kv_heads} KV heads")


@check
def qkv_kv_heads_split() -> None:
    _check_qkv(num_heads=4, num_kv_heads=2, seed=20)


@check
def qkv_one_kv_head_replicated() -> None:
    _check_qkv(num_heads=4, num_kv_heads=1, seed=30)


@check
def row_parallel_with_bias() -> None:
    out = 24
    w, b = full(out, HIDDEN, seed=40), full(out, seed=41)
    x = full(TOKENS, HIDDEN, seed=42, scale=1.0)
    layer = RowParallelLinear(HIDDEN, out, bias=True)
    assert layer.bias is not None
    assert tuple(layer.weight.shape) == (out, HIDDEN // TP)
    layer.weight.weight_loader(layer.weight, w)  # type: ignore[attr-defined]
    layer.bias.weight_loader(layer.bias, b)  # type: ignore[attr-defined]
    ref = F.linear(x, w, b)
    x_shard = cols(x, HIDDEN // TP)
    close(layer(x_shard), ref, "row-parallel")
    if packed_too(layer):
        close(layer(x_shard), ref, "row-parallel, packed")


@check
def column_parallel_gather_output() -> None:
    out = 40
    w, b = full(out, HIDDEN, seed=50), full(out, seed=51)
    x = full(TOKENS, HIDDEN, seed=52, scale=1.0)
    layer = ColumnParallelLinear(HIDDEN, out, bias=True, gather_output=True)
    assert layer.bias is not None
    assert tuple(layer.weight.shape) == (out // TP, HIDDEN)
    layer.weight.weight_loader(layer.weight, w)  # type: ignore[attr-defined]
    layer.bias.weight_loader(layer.bias, b)  # type: ignore[attr-defined]
    close(layer(x), F.linear(x, w, b), "column-parallel, gathered")
    if packed_too(layer):
        close(layer(x), F.linear(x, w, b), "column-parallel, gathered, packed")


@check
def lm_head_untied() -> None:
    vocab, dim = 1000, HIDDEN
    w = full(vocab, dim, seed=60)
    h = full(TOKENS, dim, seed=61, scale=1.0)
    head = ParallelLMHead(vocab, dim)
    head.weight.weight_loader(head.weight, w)  # type: ignore[attr-defined]
    logits = head(h)
    assert logits.is_contiguous()
    close(logits, F.linear(h, w), "LM head")
    if packed_too(head):
        assert head.weight.numel() == 0, "an untied head keeps only the packed copy"
        close(head(h), F.linear(h, w), "LM head, packed")


@check
def lm_head_tied() -> None:
    vocab, dim = 1000, HIDDEN
    w = full(vocab, dim, seed=70)
    h = full(TOKENS, dim, seed=71, scale=1.0)
    ids = torch.tensor([0, 511, 512, 999])
    emb, head = VocabParallelEmbedding(vocab, dim), ParallelLMHead(vocab, dim)
    head.tie_to(emb)
    assert head.weight is emb.weight
    emb.weight.weight_loader(emb.weight, w)  # type: ignore[attr-defined]
    close(head(h), F.linear(h, w), "tied LM head")
    if packed_too(head):
        close(head(h), F.linear(h, w), "tied LM head, packed")
        close(emb(ids), F.embedding(ids, w), "embedding under a packed tied head")


# --- the group API -------------------------------------------------------------------
@check
def tp_group_collectives() -> None:
    tp, me = ps.get_tp_group(), rank()
    assert tp.ranks == [0, 1] and tp.world_size == 2 and tp.rank == me
    x = torch.arange(24.0).reshape(2, 3, 4) + 100 * me
    parts = [torch.arange(24.0).reshape(2, 3, 4) + 100 * r for r in range(TP)]
    assert torch.equal(tp.all_reduce(x.clone()), parts[0] + parts[1]), "all_reduce"
    for dim in (0, 1, -1):
        assert torch.equal(tp.all_gather(x, dim), torch.cat(parts, dim)), f"all_gather {dim}"
    gathered = tp.gather(x, dst=1, dim=1)
    if me == 1:
        assert gathered is not None and torch.equal(gathered, torch.cat(parts, 1)), "gather"
    else:
        assert gathered is None, "gather returns None off the destination"
    y = x.clone()
    assert torch.equal(tp.broadcast(y, src=1), parts[1]) and torch.equal(y, parts[1])
    obj = {"step": 3, "ids": [1, 2, 3], "name": "é", "raw": b"\x00\x01", "none": None}
    got = tp.broadcast_object(obj if me == 1 else None, src=1)
    assert got == obj, f"broadcast_object: {got!r}"
    tp.barrier()


@check
def pp_tensor_dicts() -> None:
    # The same two processes as two pipeline stages of one rank each.
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_parallel_size=1, pipeline_parallel_size=2)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    me = ps.get_world_group().rank
    assert tp.world_size == 1 and tp.ranks == [me], tp.ranks
    assert pp.ranks == [0, 1] and pp.rank_in_group == me
    assert (pp.is_first_rank, pp.is_last_rank) == (me == 0, me == 1)
    sent = {
        "hidden_states": full(5, 16, seed=80),
        "residual": full(5, 16, seed=81).to(torch.bfloat16),
        "positions": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 16),
        "strided": full(16, 5, seed=82).t(),  # not contiguous
    }
    if me == 0:
        pp.send_tensor_dict(sent)  # to the next stage
        back = pp.recv_tensor_dict(src=1)
        assert list(back) == ["echo"] and torch.equal(back["echo"], sent["positions"] * 2)
    else:
        got = pp.recv_tensor_dict()  # from the previous stage
        assert list(got) == list(sent), list(got)
        for key, t in sent.items():
            assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
        pp.send_tensor_dict({"echo": got["positions"] * 2}, dst=0)
    for src in (0, 1):
        got = pp.broadcast_object([src, "x"] if me == src else None, src=src)
        assert got == [src, "x"], f"broadcast_object from {src}: {got!r}"


@check
def teardown_leaves_one_rank() -> None:
    ps.destroy_distributed_environment()
    assert not torch.distributed.is_initialized()
    for group in (ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()):
        assert group.world_size == 1 and group.device_group is None


CHECK_NAMES = [name for name, _ in CHECKS]


def main() -> None:
    rank_, world, init_method, out_dir = sys.argv[1:5]
    torch.set_num_threads(1)
    ps.init_distributed_environment(int(world), int(rank_), init_method, timeout=20)
    ps.initialize_model_parallel(tensor_parallel_size=TP)
    run_checks(CHECKS, Path(out_dir) / f"rank{rank_}.json", int(rank_))


if __name__ == "__main__":
    main()
