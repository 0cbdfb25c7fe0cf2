"""Micro-batches (EngineArgs.ubatch): how a step is split, when it must not be, and an
engine core with micro-batches on against one without (float32, a tiny Qwen3)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from asyncllm.config import EngineArgs
from asyncllm.messages import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.ubatch import MicroBatches, parts_independent, split_requests

from ..model.tiny import make_tiny_model, tiny_engine_core


def test_a_step_splits_into_runs_of_whole_requests_balanced_by_tokens():
    qsl = np.array([0, 100, 110, 120, 300])
    assert split_requests(qsl, 2) == [(0, 3), (3, 4)]  # 120 | 180 tokens
    assert split_requests(qsl, 3) == [(0, 1), (1, 3), (3, 4)]
    assert split_requests(qsl, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_requests(np.array([0, 5, 6]), 3) == [(0, 1), (1, 2)]  # (fewer requests)
    assert split_requests(np.array([0, 1, 2, 3, 4, 5, 6]), 2) == [(0, 3), (3, 6)]


def test_which_steps_are_split():
    parts = MicroBatches(2, "LlamaForCausalLM", 64, np_device := _cpu())
    assert parts.plan(np.array([0, 7])) is None  # one request
    assert parts.plan(np.array([0, 7, 9])) == [(0, 1), (1, 2)]
    assert parts.plan(np.array([0, 1, 2, 3])) is None  # one-token decodes: never split
    off = MicroBatches("auto", "LlamaForCausalLM", 64, np_device)
    assert off.plan(np.array([0, 4000, 8000])) is None  # (no measurement says it pays)


def _cpu():
    import torch

    return torch.device("cpu")


def test_a_part_that_reads_what_an_earlier_part_writes_is_not_split_off():
    # block size 4; request 0 writes slots 0-7 (blocks 0, 1); request 1 (2 new tokens,
    # 10 keys) reads blocks 0 and 1 as its context, written in this very step
    qsl = np.array([0, 8, 10])
    seq_lens = np.array([8, 10])
    tables = np.array([[[0, 1, 0], [0, 1, 2]]])
    slots = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert not parts_independent([(0, 1), (1, 2)], qsl, seq_lens, tables, slots, 4)
    # the same, with request 1's context in blocks 3 and 4 (cached before this step)
    tables = np.array([[[0, 1, 0], [3, 4, 2]]])
    assert parts_independent([(0, 1), (1, 2)], qsl, seq_lens, tables, slots, 4)
    # the other way round: request 0 (2 new tokens, 6 keys) reads block 0, which request
    # 1 (the later part) writes in this step
    qsl, seq_lens = np.array([0, 2, 6]), np.array([6, 4])
    tables = np.array([[[0, 5, 0], [0, 0, 0]]])
    slots = np.array([[22, 23, 0, 1, 2, 3]])
    assert not parts_independent([(0, 1), (1, 2)], qsl, seq_lens, tables, slots, 4)


@pytest.mark.parametrize("value", ["fast", 1, 0, 2.5, True])
def test_bad_settings_are_refused(value):
    with pytest.raises((ValueError, TypeError), match="ubatch"):
        EngineArgs(ubatch=value)


def test_settings_from_the_command_line():
    assert EngineArgs(ubatch="3").ubatch == 3
    assert EngineArgs(ubatch="auto").ubatch == "auto"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-ubatch")
    make_tiny_model("qwen3", folder)
    return folder


def _run(core, prompts, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", p, params, None, max_tokens, time.monotonic()))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_unfinished_requests() or core.has_pending_outputs():
        for o in core.step().outputs:
            assert o.error is None, o.error
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_logprobs is not None:
                logprobs.setdefault(o.request_id, []).extend(
                    row[0] for row in o.new_logprobs.logprobs
                )
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    return tokens, logprobs


def test_micro_batches_give_the_plain_paths_outputs(tiny_qwen3, monkeypatch):
    """Prompts arriving over several steps, so prefill chunks run beside decodes (mixed
    steps, split in two); a shared prefix that later requests of the same step read (hits
    on blocks computed in that step) keeps its step whole. Greedy tokens equal, logprobs within 1e-5."""
    rng = np.random.default_rng(0)
    shared = rng.integers(5, 380, size=32).tolist()  # (two blocks, computed in step 1)
    prompts = [shared + [1, 2], shared + [7, 8, 9], shared + [10, 11]]
    prompts += [rng.integers(5, 380, size=n).tolist() for n in (40, 9, 23, 61, 5, 17, 33, 12)]
    settings = dict(max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=True)
    from asyncllm.worker import model_runner

    refused = []

    def check(*args):
        ok = parts_independent(*args)
        refused.append(not ok)
        return ok

    monkeypatch.setattr(model_runner, "parts_independent", check)
    results = []
    for ubatch in ("off", 2):
        core = tiny_engine_core(tiny_qwen3, ubatch=ubatch, **settings)
        try:
            results.append(_run(core, prompts))
            split = core.executor.worker.runner.num_split_steps  # type: ignore[attr-defined]
        finally:
            core.shutdown()
    (plain_tokens, plain_lp), (ub_tokens, ub_lp) = results
    assert split > 3  # (the runs above did go through micro-batches)
    assert any(refused)  # (and the shared prefix kept a step whole)
    assert ub_tokens == plain_tokens
    for rid, lps in plain_lp.items():
        np.testing.assert_allclose(ub_lp[rid], lps, atol=1e-5)
