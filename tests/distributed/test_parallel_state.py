"""parallel_state without other processes: the rank layout, the one-rank default,
refusals of sizes that cannot shard a model, and a world initialized again after
teardown. The collectives across ranks run in test_tensor_parallel.py."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from asyncllm.distributed import parallel_state as ps
from asyncllm.distributed.parallel_state import GroupCoordinator, group_layout
from asyncllm.model.layers.embedding import ParallelLMHead, padded_vocab_size
from asyncllm.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    shard_attention_heads,
)


def test_rank_layout_world_4_is_tp2_by_pp2():
    tp_groups, pp_groups = group_layout(4, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert tp_groups == [[0, 1], [2, 3]]  # contiguous ranks
    assert pp_groups == [[0, 2], [1, 3]]  # strided by the TP size
    assert group_layout(8, 4, 2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert group_layout(2, 1, 2) == ([[0], [1]], [[0, 1]])
    assert group_layout(2, 2, 1) == ([[0, 1]], [[0], [1]])


def test_rank_layout_refuses_a_world_of_another_size():
    with pytest.raises(ValueError, match=r"world size \(6\).*\(2\).*\(2\) = 4"):
        group_layout(6, 2, 2)
    with pytest.raises(ValueError, match=r"at least 1"):
        group_layout(0, 0, 1)


def test_a_coordinator_knows_where_its_rank_sits():
    # Rank 3 of world 4 = TP 2 x PP 2: TP rank 1 of stage 1.
    pp = GroupCoordinator(name="pp", ranks=[1, 3], rank=3)
    assert (pp.rank_in_group, pp.world_size, pp.first_rank, pp.last_rank) == (1, 2, 1, 3)
    assert pp.is_last_rank and not pp.is_first_rank
    assert (pp.prev_rank, pp.next_rank) == (1, 1)
    with pytest.raises(ValueError, match="rank 2 is not in group 'tp'"):
        GroupCoordinator(name="tp", ranks=[0, 1], rank=2)


def test_with_nothing_initialized_every_group_is_one_rank_and_runs_nothing():
    assert not dist.is_initialized()
    x = torch.arange(6.0).reshape(2, 3)
    for group in (ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()):
        assert (group.world_size, group.rank, group.rank_in_group) == (1, 0, 0)
        assert group.all_reduce(x) is x and group.all_gather(x, -1) is x
        assert group.gather(x) is x and group.broadcast(x) is x
        assert group.broadcast_object({"a": 1}) == {"a": 1}
        group.barrier()
    ps.initialize_model_parallel(1, 1)  # no world: nothing to build
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed_environment"):
        ps.initialize_model_parallel(2, 1)
    # The layers at TP 1: whole weights, no padding.
    head = ParallelLMHead(1000, 8)
    assert tuple(head.weight.shape) == (1000, 8) and padded_vocab_size(1000, 1) == 1000


def test_the_vocabulary_pads_to_64_rows_per_rank():
    assert [padded_vocab_size(1000, tp) for tp in (2, 3, 4)] == [1024, 1152, 1024]
    assert padded_vocab_size(49152, 3) == 49152  # SmolLM2 at TP 3: no padding needed
    assert padded_vocab_size(128256, 4) == 128256


# --- sizes a tensor-parallel group cannot shard ----------------------------------------
@pytest.fixture
def tp_of(monkeypatch):
    """Makes get_tp_group() a group of `size` ranks (no process groups: the layers'
    constructors read only its size and rank)."""

    def set_size(size: int, rank: int = 0) -> GroupCoordinator:
        group = GroupCoordinator(name="tp", ranks=list(range(size)), rank=rank)
        monkeypatch.setattr(ps, "_TP", group)
        return group

    return set_size


def test_attention_heads_that_cannot_shard_are_refused(tp_of):
    tp_of(2)
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads .* size of 2"):
        QKVParallelLinear(576, 64, num_heads=9, num_kv_heads=3)
    tp_of(4)
    with pytest.raises(
        ValueError, match=r"12 attention heads and 6 KV heads .* 6 is not divisible by 4"
    ):
        QKVParallelLinear(96, 8, num_heads=12, num_kv_heads=6)
    tp_of(3)
    with pytest.raises(
        ValueError, match=r"6 attention heads and 2 KV heads .* 3 must be a multiple of 2"
    ):
        QKVParallelLinear(48, 8, num_heads=6, num_kv_heads=2)
    # Fewer KV heads than ranks: replicated.
    tp_of(4, rank=3)
    qkv = QKVParallelLinear(64, 8, num_heads=8, num_kv_heads=2)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_replicas) == (2, 1, 2)
    assert tuple(qkv.weight.shape) == ((2 + 2 * 1) * 8, 64)
    assert shard_attention_heads(9, 3, 3) == (3, 1, 1)


def test_linear_sizes_that_cannot_shard_are_refused(tp_of):
    tp_of(4)
    with pytest.raises(ValueError, match=r"input size \(30\) .* tensor-parallel size \(4\)"):
        RowParallelLinear(30, 8)
    with pytest.raises(ValueError, match=r"output size \(30\) .* tensor-parallel size \(4\)"):
        ColumnParallelLinear(8, 30)
    with pytest.raises(ValueError, match=r"merged output size \(50\) .* size \(4\)"):
        MergedColumnParallelLinear(8, [48, 50])


def test_a_rank_loads_only_its_shard(tp_of):
    tp_of(2, rank=1)
    layer = RowParallelLinear(4, 2)
    full = torch.arange(8.0).reshape(2, 4)
    layer.weight.weight_loader(layer.weight, full)  # type: ignore[attr-defined]
    assert torch.equal(layer.weight, full[:, 2:])
    with pytest.raises(ValueError, match=r"shape \(2, 2\), expected \(2, 4\)"):
        layer.weight.weight_loader(layer.weight, full[:, :2])  # type: ignore[attr-defined]


# --- a process initializes, tears down, and initializes again ---------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialize_again_after_teardown(tmp_path):
    methods = [f"tcp://127.0.0.1:{_free_port()}", f"file://{tmp_path / 'rendezvous'}"]
    try:
        for init_method in methods:
            world = ps.init_distributed_environment(1, 0, init_method, backend="gloo", timeout=10)
            assert dist.is_initialized() and ps.get_world_group() is world
            with pytest.raises(RuntimeError, match="already initialized"):
                ps.init_distributed_environment(1, 0, init_method)
            ps.initialize_model_parallel(1, 1)
            assert ps.model_parallel_is_initialized()
            tp = ps.get_tp_group()
            assert (tp.ranks, tp.world_size, tp.device_group) == ([0], 1, None)
            ps.destroy_model_parallel()
            with pytest.raises(ValueError, match=r"world size \(1\)"):
                ps.initialize_model_parallel(2, 1)
            ps.initialize_model_parallel(1, 1)
            world.barrier()
            ps.destroy_distributed_environment()
            assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
            assert ps.get_world_group().world_size == 1
    finally:
        ps.destroy_distributed_environment()
