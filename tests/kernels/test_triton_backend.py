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


def test_short_chunks_through_the_model_match_torch_native(tmp_path):
    """Steps like a speculative verification's (1 to 5 tokens per sequence, every
    position's logits) after the prompts: one launch of short tiles with the keys split
    (2 sequences x 2 KV heads is fewer programs than the interpreter's 8 "SMs"), merged
    per token, against torch-native attention on the same weights."""
    from asyncllm_kernels.paged_attention import choose_config, short_launch
    from tests.model.helpers import use_backend
    from tests.model.paged_decoder import PagedDecoder

    make_tiny_model("qwen3", tmp_path)
    cfg = create_model_config(EngineArgs(model=str(tmp_path), device="cpu"))
    model = load_model(cfg, TorchNativeBackend())
    hf = cfg.hf_config
    group = hf.num_attention_heads // hf.num_key_value_heads
    assert short_launch(5, group)
    split = choose_config(2, hf.num_key_value_heads, group, hf.head_dim, True,
                          torch.device("cpu"), torch.float32, query_len=5).num_splits  # fmt: skip
    assert split > 1
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (90, 40)]
    steps = [[5, 3], [1, 5], [4, 2]]
    drafts = [[torch.randint(0, 384, (n,), generator=gen).tolist() for n in s] for s in steps]

    def run(backend):
        use_backend(model, backend)
        dec = PagedDecoder(model, backend, num_blocks=64)
        sids = [dec.add_sequence() for _ in prompts]
        dec.step(dict(zip(sids, prompts, strict=True)))
        outs = []
        for chunk in drafts:
            step = dec.step(dict(zip(sids, chunk, strict=True)), all_logits=True)
            outs += [step[s].reshape(-1, step[s].shape[-1]) for s in sids]
        return torch.cat(outs).float()

    with torch.no_grad():
        got = run(TritonAttentionBackend())
        want = run(TorchNativeBackend())
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-4, f"relative logits difference {rel:.2e}"
