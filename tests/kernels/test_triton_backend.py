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
@pytest.mark.parametrize("rotary_kernel", [False, True])
def test_triton_backend_matches_torch_native(tmp_path, arch, rotary_kernel, monkeypatch):
    """With `rotary_kernel`, the rotary launch runs as on CUDA: it rotates q, applies
    Qwen3's q/k norms and writes the step's K/V into the cache itself."""
    import asyncllm_kernels.rotary as kernels
    from asyncllm.model.layers import rotary

    make_tiny_model(arch, tmp_path)
    cfg = create_model_config(EngineArgs(model=str(tmp_path), device="cpu"))
    model = load_model(cfg, TorchNativeBackend())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (70, 1, 23)]
    launches = []
    if rotary_kernel:
        fused = kernels.rotate_into_kv_cache_
        monkeypatch.setattr(rotary, "uses_kernels", lambda t: True)
        monkeypatch.setattr(
            kernels, "rotate_into_kv_cache_", lambda *a, **kw: launches.append(fused(*a, **kw))
        )
    with torch.no_grad():
        got = run_steps_with_backend(model, TritonAttentionBackend(), prompts, 3)
        monkeypatch.undo()
        want = run_steps_with_backend(model, TorchNativeBackend(), prompts, 3)
    # Five steps (two prefill chunks, three decodes), each through every layer.
    assert len(launches) == (5 * cfg.hf_config.num_hidden_layers if rotary_kernel else 0)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-4, f"relative logits difference {rel:.2e}"
