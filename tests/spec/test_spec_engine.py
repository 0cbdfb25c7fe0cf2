"""Speculative decoding end to end on the CPU runner (a tiny random Llama, float32):
with drafts verified, every request's output (tokens, finish, logprobs) is the one it
gets without them: greedy, seeded sampling with penalties and min_tokens, stop tokens,
max_tokens, async scheduling on and off, a KV cache small enough to preempt, aborts
mid-speculation (every block back), and a seeded request alone or beside 63 others."""

from __future__ import annotations

import math
from typing import Any

import pytest

from asyncllm.messages import EngineCoreRequest
from tests.engine.test_async_scheduling import _core, _request, _run, _summary
from tests.model.tiny import make_tiny_model

# (every request of the workloads below speculates: fewer than 16 at once)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 16}  # fmt: skip
VOCAB = 384


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-spec")
    make_tiny_model("llama3", folder)
    return folder


def _prompt(i: int, n: int) -> list[int]:
    """Text that repeats itself (a period of 5 to 9 tokens), as text to quote does."""
    period = [(i * 53 + 17 * j) % VOCAB for j in range(5 + i % 5)]
    return (period * (n // len(period) + 1))[:n]


def _workload() -> list[EngineCoreRequest]:
    reqs = []
    for i in range(8):
        extra: dict[str, Any] = {}
        if i == 4:  # (greedy, penalized: a draft's count changes the positions after it)
            extra = dict(repetition_penalty=1.3, frequency_penalty=0.4)
        elif i % 4 == 1:
            extra = dict(temperature=0.8, seed=100 + i, top_k=40, repetition_penalty=1.2)
        elif i % 4 == 2:
            extra = dict(temperature=0.7, seed=200 + i, presence_penalty=0.5,
                         frequency_penalty=0.3, min_tokens=6)  # fmt: skip
        elif i % 4 == 3:
            extra = dict(temperature=1.0, seed=300 + i, top_p=0.9)
        if i in (0, 3, 5):
            extra["logprobs"] = 3
        reqs.append(_request(f"s{i}", _prompt(i, 10 + 4 * i), 12 + 3 * i, **extra))
    # Greedy among three favoured tokens, steered by their counts: drafts are accepted
    # only where each position counts the drafts before it.
    bias = {5: 100.0, 6: 99.5, 7: 99.0}
    reqs.append(_request("steered", [5, 6] * 4, 30, logit_bias=bias, frequency_penalty=1.0))
    return reqs


def _outputs(folder, spec, workload=_workload, abort_after=None, **extra):
    core = _core(folder, extra.pop("async_scheduling", True), speculative_config=spec, **extra)
    try:
        outs = _run(core, workload(), abort_after)
        return _summary(outs), core.scheduler.stats
    finally:
        core.shutdown()


def _same(got: dict, want: dict) -> None:
    """Equal tokens, finish and stop reasons, logprobs within 1e-4."""
    assert got.keys() == want.keys()
    for rid in want:
        g, w = got[rid], want[rid]
        assert g[:3] == w[:3], rid
        g_lp = [x for lp in g[3] for x in zip(lp.token_ids, lp.logprobs, lp.ranks)]
        w_lp = [x for lp in w[3] for x in zip(lp.token_ids, lp.logprobs, lp.ranks)]
        assert len(g_lp) == len(w_lp), rid
        for (gi, gl, gr), (wi, wl, wr) in zip(g_lp, w_lp):
            assert gi == wi and gr == wr, rid
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(gl, wl)), rid


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_equal_speculation_off(tiny_folder, async_scheduling):
    want, _ = _outputs(tiny_folder, None, async_scheduling=async_scheduling)
    got, stats = _outputs(tiny_folder, SPEC, async_scheduling=async_scheduling)
    _same(got, want)
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert any(s[3] for s in want.values())  # (logprobs were compared)


def test_preemption_and_aborts_mid_speculation(tiny_folder):
    """A pool of 24 blocks of 4 tokens for 8 requests of up to 70 tokens: they preempt
    each other; two are aborted after a few tokens. `_run` checks every block back."""
    abort = {"s2": 5, "s6": 9}
    small = dict(num_gpu_blocks_override=24, max_model_len=80)
    want, _ = _outputs(tiny_folder, None, abort_after=abort, **small)
    got, stats = _outputs(tiny_folder, SPEC, abort_after=abort, **small)
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
    _same(got, want)


def test_a_seeded_request_is_the_same_alone_and_under_load(tiny_folder):
    """Alone it speculates; admitted as the 64th it does not (disable_by_batch_size):
    its tokens are the same, since each position's draw is seeded by its position."""

    def one() -> EngineCoreRequest:
        return _request("seeded", _prompt(3, 20), 24, temperature=0.9, seed=7, top_k=50)

    def crowd() -> list[EngineCoreRequest]:
        others = [_request(f"o{i}", _prompt(i, 8), 4, temperature=0.5, seed=i) for i in range(63)]
        return others + [one()]

    alone, stats = _outputs(tiny_folder, SPEC, workload=lambda: [one()])
    loaded, _ = _outputs(tiny_folder, SPEC, workload=crowd)
    assert stats.spec_num_drafts > 0
    assert loaded["seeded"] == alone["seeded"]


def test_padded_verification_steps_compute_what_unpadded_ones_do(tiny_folder):
    """The runner pads a step verifying drafts to a verification graph's shape (sizes
    2/4/8 of 1 + k tokens per request) on the CPU as on CUDA (only the replay is
    CUDA's): chunks shorter than 1 + k and padded requests change no output, and the
    padded path was taken."""
    want, _ = _outputs(tiny_folder, None)
    core = _core(tiny_folder, True, speculative_config=SPEC)
    runner = core.executor.worker.runner  # type: ignore[attr-defined]
    runner.capture_sizes = [2, 4, 8]
    runner.verify_graphs = ([2, 4, 8], 1 + SPEC["num_speculative_tokens"])
    shapes: list[tuple[int | None, int]] = []
    prepare = runner._prepare_inputs

    def spy(scheduled, *args):
        inputs = prepare(scheduled, *args)
        shapes.append((inputs.graph_size, inputs.graph_query_len))
        return inputs

    runner._prepare_inputs = spy
    try:
        got = _summary(_run(core, _workload()))
    finally:
        core.shutdown()
    _same(got, want)
    verified = {size for size, q in shapes if q == 5}
    assert verified and verified <= {2, 4, 8}, shapes
    assert any(q == 1 and size is not None for size, q in shapes)  # (padded decodes too)


def _with_processors() -> list[EngineCoreRequest]:
    """Requests steered by processors that read the output ids: a cycle of tokens that
    the prompt repeats (so drafts of it are right only where each draft position counts
    the drafts before it), and no immediate repeats, greedy and seeded."""
    cycle = [11, 12, 13, 14]
    reqs = [
        _request("cycle", cycle * 4, 24, extra_args={"cycle": cycle}),
        _request(
            "cycle-seeded",
            [7] + cycle * 3,
            20,
            temperature=0.9,
            seed=5,
            extra_args={"cycle": cycle[::-1]},
        ),  # fmt: skip
        _request("no-repeat", _prompt(1, 30), 20, extra_args={"no_repeat": True}),
        _request(
            "no-repeat-seeded",
            _prompt(2, 30),
            20,
            temperature=0.8,
            seed=9,
            extra_args={"no_repeat": True},
        ),  # fmt: skip
    ]
    return reqs + _workload()[:3]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_logits_processors_see_the_drafts_before_each_position(tiny_folder, async_scheduling):
    procs = ["tests.engine.processors:CycleTokens", "tests.engine.processors:NoRepeat"]
    kw = dict(workload=_with_processors, logits_processors=procs, async_scheduling=async_scheduling)
    want, _ = _outputs(tiny_folder, None, **kw)
    got, stats = _outputs(tiny_folder, SPEC, **kw)
    _same(got, want)
    assert want["cycle"][0] == ([11, 12, 13, 14] * 6)  # (the processor steered it)
    assert stats.spec_num_accepted_tokens >= 8
