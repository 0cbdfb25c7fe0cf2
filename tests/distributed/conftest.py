"""Fixtures of the engine-level distributed tests (shared by their modules: the models
are built, and the reference engine started, once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import LLM
from tests.distributed.engines import GREEDY, PROMPTS, TINY, as_inputs
from tests.model.tiny import make_tiny_model


@pytest.fixture(scope="package")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random models: llama3 with 4 heads and 2 KV heads (one per rank at TP=2), qwen2
    with 1 KV head (replicated at TP=2; q/k/v biases), gemma3 (a windowed and a global
    layer: two KV cache groups, one per pipeline stage at PP=2)."""
    root = tmp_path_factory.mktemp("tiny-tp")
    out = {}
    for arch in ("llama3", "qwen2", "gemma3"):
        make_tiny_model(arch, root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="package")
def reference(tiny_models):
    """TP=1 (the one-process executor): greedy outputs of PROMPTS per model, and the
    llama3 engine itself."""
    engines = {
        arch: LLM(str(path), multiprocess=False, num_gpu_blocks_override=64, **TINY)
        for arch, path in tiny_models.items()
    }
    greedy = {
        arch: llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)
        for arch, llm in engines.items()
    }
    engines["qwen2"].shutdown()
    engines["gemma3"].shutdown()
    yield engines["llama3"], greedy
    engines["llama3"].shutdown()
