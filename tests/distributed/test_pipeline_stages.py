"""Pipeline-parallel stages of the model (`model/pipeline.py`, the Llama family).

Without processes: how layers split over stages (vLLM's split, the
ASYNCLLM_PP_LAYER_PARTITION override and its refusals) and what each stage of a model
holds, built under a pipeline group of three ranks that sends nothing. With two
processes (gloo over loopback, `pp_worker.py`, one start): stage 0 sends its hidden
states and residual, stage 1 computes the logits, equal to one stage's.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm.distributed import parallel_state as ps
from asyncllm.distributed.parallel_state import GroupCoordinator
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.interface import KVCacheSpec
from asyncllm.model.models.llama import LlamaForCausalLM
from asyncllm.model.pipeline import (
    PP_LAYER_PARTITION_ENV,
    PipelineStage,
    PPMissingLayer,
    stage_layers,
    stage_partition,
)
from tests.distributed.pp_worker import (
    CHECK_NAMES,
    HEAD_DIM,
    stage_names,
    tiny_llama_checkpoint,
    tiny_llama_config,
)
from tests.distributed.ranks import RankRun, assert_check_passed, run_ranks


@pytest.fixture(autouse=True)
def no_partition(monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)


# --- the split ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_layers, pp_size, counts",
    [
        (24, 1, [24]),
        (24, 2, [12, 12]),
        (2, 2, [1, 1]),
        # The layers left over go to the stages before the last, from the second-to-last
        # backwards (vLLM's get_pp_indices): the last also holds the norm and LM head.
        (3, 2, [2, 1]),
        (4, 3, [1, 2, 1]),
        (5, 3, [2, 2, 1]),
        (7, 4, [2, 2, 2, 1]),
        (32, 3, [11, 11, 10]),
        (3, 3, [1, 1, 1]),
    ],
)
def test_even_split(num_layers, pp_size, counts):
    assert stage_partition(num_layers, pp_size) == counts
    ranges = [stage_layers(num_layers, r, pp_size) for r in range(pp_size)]
    assert [end - start for start, end in ranges] == counts
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous


def test_the_environment_overrides_the_split(monkeypatch):
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "4, 6,6,4")
    assert [stage_layers(20, r, 4) for r in range(4)] == [(0, 4), (4, 10), (10, 16), (16, 20)]
    # An explicit partition wins over the environment.
    assert stage_layers(20, 1, 2, partition="15,5") == (15, 20)
    # One stage holds every layer: the variable is not read.
    assert stage_layers(20, 0, 1) == (0, 20)


@pytest.mark.parametrize(
    "partition, match",
    [
        ("5,5,5", r"names 3 stages, but pipeline_parallel_size is 4"),
        ("5,5,5,6", r"sums to 21 layers, but the model has 20"),
        ("5,5,5,a", r"not a comma-separated list of layer counts"),
        ("5,5,5,5,", r"not a comma-separated list"),
        ("10,10,0,0", r"every stage needs at least one layer"),
        ("11,10,-1,0", r"every stage needs at least one layer"),
    ],
)
def test_a_partition_that_does_not_fit_is_refused(monkeypatch, partition, match):
    with pytest.raises(ValueError, match=PP_LAYER_PARTITION_ENV):
        stage_layers(20, 0, 4, partition=partition)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, partition)
    with pytest.raises(ValueError, match=match):
        stage_layers(20, 0, 4)


def test_more_stages_than_layers_and_bad_ranks_are_refused():
    with pytest.raises(ValueError, match=r"cannot split 2 layers over 3 pipeline stages"):
        stage_layers(2, 0, 3)
    with pytest.raises(ValueError, match=r"pipeline rank 2 is outside 2 stages"):
        stage_layers(8, 2, 2)
    with pytest.raises(ValueError, match=r"at least 1"):
        stage_partition(8, 0)


# --- what a stage holds (no processes: a pipeline group that sends nothing) ---------------
def stage_model(monkeypatch, config, pp_rank: int, pp_size: int) -> LlamaForCausalLM:
    monkeypatch.setattr(ps, "_PP", GroupCoordinator("pp", list(range(pp_size)), rank=pp_rank))
    model = LlamaForCausalLM(config, TorchNativeBackend())
    monkeypatch.setattr(ps, "_PP", None)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_each_of_three_stages_holds_only_its_own(monkeypatch, tied):
    config = tiny_llama_config(5, tied=tied)  # split 2 + 2 + 1
    whole = LlamaForCausalLM(config, TorchNativeBackend())
    assert whole.stage == PipelineStage(0, 1, 0, 5, 5)
    assert not any(isinstance(m, PPMissingLayer) for m in whole.modules())
    all_names = set(dict(whole.named_parameters()))
    weights = tiny_llama_checkpoint(config, seed=3)
    assert all(whole.holds_weight(n) for n in weights)
    held_anywhere: set[str] = set()
    for rank, layers in enumerate([range(0, 2), range(2, 4), range(4, 5)]):
        model = stage_model(monkeypatch, config, rank, 3)
        first, last = rank == 0, rank == 2
        embedding = first or (tied and last)
        names = set(dict(model.named_parameters()))
        assert names == stage_names(all_names, layers, embedding, last), sorted(names)
        assert model.kv_cache_spec() == KVCacheSpec(len(layers), 2, HEAD_DIM, layers.start)
        assert model.stage.layers == layers
        # Loading the whole checkpoint fills this stage and skips the rest.
        assert model.load_weights(weights.items()) == names == model.expected_parameters()
        held = {n for n in weights if model.holds_weight(n)}
        assert held == stage_names(set(weights), layers, embedding, last)
        held_anywhere |= held
        if not last:
            with pytest.raises(RuntimeError, match="LM head belongs to another pipeline stage"):
                model.compute_logits(torch.zeros(1, config.hidden_size))
        if not first:
            with pytest.raises(ValueError, match=f"pipeline stage {rank} needs the previous"):
                model(torch.zeros(3, dtype=torch.long), torch.arange(3), [], None)
            t = model.make_empty_intermediate_tensors(7, torch.float32, torch.device("cpu"))
            assert {k: tuple(v.shape) for k, v in t.items()} == {
                "hidden_states": (7, 64),
                "residual": (7, 64),
            }
    assert held_anywhere == set(weights)  # every tensor has a stage


def test_an_unknown_weight_of_a_local_layer_is_still_refused(monkeypatch):
    model = stage_model(monkeypatch, tiny_llama_config(4, tied=False), 1, 2)  # layers 2, 3
    skipped = [("model.layers.0.self_attn.bogus.weight", torch.zeros(1))]
    assert model.load_weights(skipped) == set()  # another stage's: not read at all
    with pytest.raises(ValueError, match="model.layers.3.self_attn.bogus.weight"):
        model.load_weights([("model.layers.3.self_attn.bogus.weight", torch.zeros(1))])


# --- two stages in two processes ---------------------------------------------------------
@pytest.fixture(scope="module")
def rank_run(tmp_path_factory) -> RankRun:
    return run_ranks(
        "tests.distributed.pp_worker", 2, tmp_path_factory.mktemp("pp2"), deadline_s=90
    )


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_at_pp2(rank_run, name):
    assert_check_passed(rank_run, name)
