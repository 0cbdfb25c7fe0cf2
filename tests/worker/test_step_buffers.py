"""The model runner's persistent step buffers and CUDA-graph padding, on the CPU: the
capture ladder, inert padding, padded steps computing what unpadded ones compute, and
decode steps that build no tensor from Python lists."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
import torch

from asyncllm.config import EngineArgs, default_capture_sizes
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_config import create_engine_config
from asyncllm.messages import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.step_buffers import StepBuffers, padded_size
from tests.model.tiny import make_tiny_model, tiny_engine_core

VOCAB = 384
_ids = itertools.count()


def test_the_default_capture_ladder():
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(1024)[-1] == 512  # larger decode batches run eager
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(12) == [1, 2, 4, 8, 12]


def test_padded_size_is_the_smallest_captured_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert padded_size(17, sizes) is None


def test_capture_sizes_follow_the_device_and_enforce_eager(tiny_folder):
    cpu = create_engine_config(EngineArgs(model=str(tiny_folder), device="cpu"))
    assert cpu.cudagraph_capture_sizes == []  # no graphs on the CPU
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(cudagraph_capture_sizes=[0, 4])
    with pytest.raises(TypeError, match="cudagraph_capture_sizes"):
        EngineArgs(cudagraph_capture_sizes=4)  # type: ignore[arg-type]
    assert EngineArgs(cudagraph_capture_sizes=[8, 1, 8]).cudagraph_capture_sizes == [1, 8]


def test_padding_is_inert():
    buf = StepBuffers(16, 8, 4, torch.device("cpu"))
    buf.query_start_loc.np[:4] = [0, 1, 2, 3]
    buf.seq_lens.np[:3] = [5, 6, 7]
    buf.slot_mapping.np[:] = 99
    buf.block_table.np[:] = 3
    buf.pad(3, 3, 8, 8)
    assert buf.query_start_loc.np[:9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert buf.seq_lens.np[:8].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert buf.slot_mapping.np[0, :8].tolist() == [99, 99, 99, -1, -1, -1, -1, -1]
    assert (buf.block_table.np[:, 3:8] == 0).all() and (buf.block_table.np[:, :3] == 3).all()
    # On the CPU the device twin is the host buffer: nothing to copy, no second copy.
    assert buf.seq_lens.device.data_ptr() == buf.seq_lens.cpu.data_ptr()
    assert buf.block_table.device.data_ptr() == buf.block_table.cpu.data_ptr()


def test_every_kv_cache_group_has_its_slot_mapping_and_block_table():
    """A model with several KV cache groups (model/kv_groups.py): one row of slots and
    one block table per group; padding makes every group's rows inert."""
    buf = StepBuffers(16, 8, 4, torch.device("cpu"), num_groups=3)
    assert buf.slot_mapping.np.shape == (3, 16) and buf.block_table.np.shape == (3, 8, 4)
    buf.slot_mapping.np[:] = 7
    buf.block_table.np[:] = 5
    buf.pad(2, 2, 4, 4)
    assert (buf.slot_mapping.np[:, 2:4] == -1).all() and (buf.slot_mapping.np[:, :2] == 7).all()
    assert (buf.block_table.np[:, 2:4] == 0).all() and (buf.block_table.np[:, :2] == 5).all()


def test_the_arena_views_are_disjoint_and_aligned():
    """The per-token and per-sequence arrays share one arena (one copy per step): each
    is 8-byte aligned, and writing one leaves every other as it was."""
    buf = StepBuffers(13, 5, 4, torch.device("cpu"))
    views = [buf.input_ids, buf.positions, buf.slot_mapping, buf.query_start_loc, buf.seq_lens]
    assert [v.np.shape[-1] for v in views] == [13, 13, 13, 6, 5]
    for i, v in enumerate(views):
        assert v.cpu.data_ptr() % 8 == 0
        v.np[:] = i + 1
    for i, v in enumerate(views):
        assert (v.np == i + 1).all(), i
    end = max(v.cpu.data_ptr() + v.cpu.nbytes for v in views)
    assert end <= buf.host_arena.data_ptr() + buf.host_arena.nbytes


# -- padded steps through the real runner (a tiny random Llama, torch attention) ------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-pad")
    make_tiny_model("llama3", folder)
    return folder


def _core(folder, **extra: Any) -> EngineCore:
    return tiny_engine_core(folder, **extra)


def _request(prompt: list[int], max_tokens: int, **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"p{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        eos_token_id=None,
        max_tokens=max_tokens,
        arrival_time=time.monotonic(),
    )


def _generate(core: EngineCore, reqs: list[EngineCoreRequest]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            tokens[o.request_id] += o.new_token_ids
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    return [tokens[r.request_id] for r in reqs]


def _workload(n: int) -> list[EngineCoreRequest]:
    """n requests with different prompt lengths and outputs; some end early, so the
    decode batch shrinks through sizes between the captured ones."""
    out = []
    for i in range(n):
        prompt = [(i * 37 + 11 * j) % VOCAB for j in range(3 + 5 * i)]
        extra: dict[str, Any] = {}
        if i % 3 == 1:
            extra = dict(temperature=0.8, seed=100 + i, top_k=40, repetition_penalty=1.2)
        elif i % 3 == 2:
            extra = dict(temperature=0.7, seed=200 + i, presence_penalty=0.5, frequency_penalty=0.3)
        out.append(_request(prompt, 4 + 3 * i, **extra))
    return out


def test_padded_decode_steps_compute_what_unpadded_ones_do(tiny_folder):
    """The runner pads decode steps to a captured size on the CPU as on CUDA (only the
    replay is CUDA's): the same tokens come out, greedy and seeded with penalties, and
    the padded path was taken."""
    plain = _core(tiny_folder)
    expected = _generate(plain, _workload(7))
    plain.shutdown()

    padded = _core(tiny_folder)
    runner = padded.executor.worker.runner  # type: ignore[attr-defined]
    runner.capture_sizes = [2, 4, 8]
    sizes: list[int | None] = []
    prepare = runner._prepare_inputs

    def spy(scheduled, *args):
        inputs = prepare(scheduled, *args)
        sizes.append(inputs.graph_size)
        return inputs

    runner._prepare_inputs = spy
    assert _generate(padded, _workload(7)) == expected
    assert {4, 8} <= set(sizes) and None in sizes  # padded decodes, eager prefills
    padded.shutdown()


def test_a_decode_step_builds_no_tensor_from_python_lists(tiny_folder, monkeypatch):
    """Once the requests are in the batch, a decode step goes through the buffers and
    the per-row sampling state: torch.tensor is never called."""
    core = _core(tiny_folder)
    reqs = [_request([1 + i, 2, 3], 6, temperature=0.9, top_p=0.9) for i in range(3)]
    reqs.append(_request([5, 6], 6, presence_penalty=0.4))
    for r in reqs:
        core.add_request(r)
    core.step()  # the prefills (new rows are written here)
    calls: list[Any] = []
    real = torch.tensor

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    for _ in range(3):
        out = core.step()
        assert len(out.outputs) == 4
    assert calls == []
    monkeypatch.undo()
    core.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalty_counts_follow_the_outputs(tiny_folder, async_scheduling):
    """The device-side output counts of a penalized row equal a bincount of what the
    request has produced, step after step (nothing rebuilds them); with async
    scheduling, plus the token of the step in flight."""
    core = _core(tiny_folder, async_scheduling=async_scheduling)
    req = _request([7, 8, 9, 7], 8, temperature=1.0, seed=3, frequency_penalty=0.2)
    core.add_request(req)
    runner = core.executor.worker.runner  # type: ignore[attr-defined]
    produced: list[int] = []
    most_in_flight = 0
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            produced += o.new_token_ids
        state = runner.input_batch.requests.get(req.request_id)
        if state is not None:
            counts = runner.sampling.output_counts[state.row].cpu().numpy()
            ahead = counts - np.bincount(produced, minlength=VOCAB)
            in_flight = int(runner.input_batch.num_pending[state.row])
            assert ahead.min() >= 0 and ahead.sum() == in_flight
            most_in_flight = max(most_in_flight, in_flight)
            seen = runner.sampling.prompt_mask[state.row].cpu().numpy()
            assert set(np.nonzero(seen)[0].tolist()) == {7, 8, 9}
    assert len(produced) == 8 and most_in_flight == int(async_scheduling)
    core.shutdown()
