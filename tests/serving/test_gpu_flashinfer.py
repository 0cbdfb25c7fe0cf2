"""The FlashInfer backend end to end on SmolLM2 (head size 64, three query heads per KV
head), bfloat16, decode graphs on: an engine on it against one on the Triton backend,
over batches that cross capture sizes and steps that mix prefills with decodes, under
the GPU suite's relative-norm and top-5 rules (`compare_bf16_logits`)."""

from __future__ import annotations

import importlib.util

import pytest

from asyncllm import LLM
from tests.serving.test_gpu_graphs import (
    BATCHES,
    ENGINE,
    RECORD_LOGITS,
    _runner,
    compare_bf16_logits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
    ),
]


def test_flashinfer_engine_equals_the_triton_engine_bfloat16():
    kw = dict(ENGINE, dtype="bfloat16", logits_processors=[RECORD_LOGITS])
    flashinfer = LLM(attention_backend="flashinfer", **kw)
    triton = LLM(attention_backend="triton", **kw)
    try:
        assert _runner(flashinfer).backend.name == "flashinfer"
        assert _runner(flashinfer).graphs is not None
        assert compare_bf16_logits(flashinfer, triton) >= sum(BATCHES)
        assert _runner(flashinfer).graphs.replays > 0
    finally:
        flashinfer.shutdown()
        triton.shutdown()
