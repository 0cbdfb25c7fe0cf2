"""TritonAttentionBackend through a whole model, on CPU under Triton's interpreter:
the same tiny models and steps (chunked prefill, a mixed step, decodes) through it and
through TorchNativeBackend give the same logits. The GPU tests repeat this in float32
and bfloat16 at full size (tests/model/test_gpu_triton.py)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.attention.triton_attn import TritonAttentionBackend
from asyncllm.model.loader import load_model
from tests.model.helpers import run_steps_with_backend
from tests.model.tiny import make_tiny_model


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])  # GQA + q/k norm; sliding window
def test_triton_backend_matches_torch_native(tmp_path, arch):
    make_tiny_model(arch, tmp_path)
    cfg = create_model_config(EngineArgs(model=str(tmp_path), device="cpu"))
    model = load_model(cfg, TorchNativeBackend())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (70, 1, 23)]
    with torch.no_grad():
        want = run_steps_with_backend(model, TorchNativeBackend(), prompts, 3)
        got = run_steps_with_backend(model, TritonAttentionBackend(), prompts, 3)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-4, f"relative logits difference {rel:.2e}"
