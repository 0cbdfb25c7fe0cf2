"""The optional libraries' attention backends end to end on SmolLM2 (head size 64, three
query heads per KV head), bfloat16: an engine on each against one on the Triton backend,
over batches that cross the decode graphs' capture sizes and steps that mix prefill
chunks with decodes, under the GPU suite's relative-norm and top-5 rules
(`compare_bf16_logits`). A backend that declares decode graphs runs with them on; one
whose library is not installed is skipped."""

from __future__ import annotations

import importlib.util

import pytest

from asyncllm import LLM
from asyncllm.model.attention.registry import AttentionCGSupport, library_installed
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
]

# (name, the module its library installs, whether its engine captures decode graphs)
LIBRARY_BACKENDS = [
    ("flashinfer", "flashinfer", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ("flashinfer_prefill", "flashinfer", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    ("flash_attn", "flash_attn.cute", AttentionCGSupport.NEVER),
]


@pytest.mark.parametrize(
    "name,module,graphs", LIBRARY_BACKENDS, ids=[b[0] for b in LIBRARY_BACKENDS]
)
def test_library_engine_equals_the_triton_engine_bfloat16(name, module, graphs):
    if not library_installed(module):
        pytest.skip(f"{module} (the {name} backend's library) is not installed")
    kw = dict(ENGINE, dtype="bfloat16", logits_processors=[RECORD_LOGITS])
    library = LLM(attention_backend=name, **kw)
    triton = LLM(attention_backend="triton", **kw)
    try:
        runner = _runner(library)
        assert runner.backend.name == name
        assert (runner.graphs is not None) == (graphs is not AttentionCGSupport.NEVER)
        assert compare_bf16_logits(library, triton) >= sum(BATCHES)
        if runner.graphs is not None:
            assert runner.graphs.replays > 0
    finally:
        library.shutdown()
        triton.shutdown()
