"""Structured outputs on CUDA (the embedded SmolLM2, float32, so that greedy
tokens do not depend on the batch's shape): the grammar masks reach
the device through the pinned staging buffers and the Triton mask kernel; every output
holds its constraint, with async scheduling on (the split launch) and off, and greedy
outputs are the same in both modes. Unconstrained requests sit first and last in the
batch, so the constrained rows are not the logits' first rows."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_outputs import (
    PROMPT,
    _all_kinds,
    _check_json,
    _idle,
    check_all_kinds,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("xgrammar")

ARRAY = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6}


def _engine(async_scheduling: bool) -> LLM:
    return LLM(
        device="cuda",
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.1,
        multiprocess=False,
        async_scheduling=async_scheduling,
    )


def _run(llm: LLM) -> list[list[int]]:
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [plain, *_all_kinds()]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    check_all_kinds([o.outputs[0].text for o in outs[1:]])
    # 64 rows at once: the arrays, every other request unconstrained
    batch = [
        SamplingParams(
            max_tokens=48,
            temperature=0.0 if i % 4 else 0.8,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=ARRAY) if i % 2 else None,
        )
        for i in range(128)
    ]
    wide = llm.generate([f"{PROMPT} ({i})" for i in range(128)], batch, use_tqdm=False)
    for i, o in enumerate(wide):
        if i % 2:
            _check_json(o.outputs[0].text, ARRAY)
    _idle(llm)
    return [o.outputs[0].token_ids for o in outs] + [
        o.outputs[0].token_ids for i, o in enumerate(wide) if i % 4
    ]


def test_constraints_hold_on_cuda_and_async_scheduling_changes_nothing():
    tokens = {}
    for mode in (True, False):
        llm = _engine(mode)
        try:
            tokens[mode] = _run(llm)
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]
