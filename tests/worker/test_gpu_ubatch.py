"""Micro-batches on CUDA: each part on its own stream, the same greedy tokens and
logprobs as the plain path (a tiny Qwen3 in float32, mixed steps, shared prefixes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..model.tiny import make_tiny_model, tiny_engine_core
from .test_ubatch import _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_micro_batches_on_streams_give_the_plain_paths_outputs(tmp_path, enforce_eager):
    make_tiny_model("qwen3", tmp_path)
    rng = np.random.default_rng(1)
    shared = rng.integers(5, 380, size=32).tolist()
    prompts = [shared + [1, 2], shared + [7, 8, 9]]
    prompts += [rng.integers(5, 380, size=n).tolist() for n in (40, 9, 23, 61, 5, 17, 33, 12)]
    settings = dict(
        device="cuda",
        max_num_batched_tokens=48,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )
    results, split = [], 0
    for ubatch in ("off", 2):
        core = tiny_engine_core(tmp_path, ubatch=ubatch, **settings)
        try:
            results.append(_run(core, prompts, max_tokens=12))
            split = core.executor.worker.runner.num_split_steps  # type: ignore[attr-defined]
        finally:
            core.shutdown()
    (plain_tokens, plain_lp), (ub_tokens, ub_lp) = results
    assert split > 3
    assert ub_tokens == plain_tokens
    for rid, lps in plain_lp.items():
        np.testing.assert_allclose(ub_lp[rid], lps, atol=1e-4)
