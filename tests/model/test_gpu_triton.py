"""Model-level check of the Triton attention backend against TorchNativeBackend on the
GPU: the same weights and steps (prefill chunks after cached context, mixed batches,
decodes) through both, logits compared. float32 (IEEE dots in the kernel): relative
difference <= 1e-4; bfloat16: <= 2e-2."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.registry import library_installed
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import load_model
from tests.model.helpers import run_steps_with_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
)


def _compare(model, vocab: int, tol: float, backend=None) -> None:
    """`backend` (default: Triton's) against TorchNativeBackend on the same steps."""
    from asyncllm.model.attention.triton_attn import TritonAttentionBackend

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (700, 45, 1, 300)]
    with torch.no_grad():
        want = run_steps_with_backend(model, TorchNativeBackend(), prompts, 8)
        got = run_steps_with_backend(model, backend or TritonAttentionBackend(), prompts, 8)
    assert not got.isnan().any()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= tol, f"relative logits difference {rel:.2e} > {tol:.0e}"


def _qwen3_shaped(tmp_path, dtype: str):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    args = EngineArgs(model=str(tmp_path), device="cuda", dtype=dtype, load_format="dummy")
    model = load_model(create_model_config(args), TorchNativeBackend())
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device="cuda"))
            else:  # trained-like scale: attention scores of order one, not all alike
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device="cuda"))
    return model


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_qwen3_shaped_model(tmp_path, dtype, tol):
    _compare(_qwen3_shaped(tmp_path, dtype), QWEN3_06B["vocab_size"], tol)


def test_fused_small_batch_gemms_equal_the_launches_apart(tmp_path, monkeypatch):
    """bfloat16, the Qwen3 shape: decodes of 4 rows through the skinny GEMM with its
    neighbours fused (the norms, folded into qkv and gate/up, the gate, the adds into
    o_proj and down) against the same model as loaded with every launch apart (what
    ASYNCLLM_FUSED_GEMM=1 changes); each kind of fused launch is taken."""
    import asyncllm_kernels.skinny_gemm as skinny
    from asyncllm.model.attention.triton_attn import TritonAttentionBackend
    from asyncllm.model.layers.linear import LinearBase

    model = _qwen3_shaped(tmp_path, "bfloat16")
    kinds = set()
    kernel = skinny.skinny_gemm

    def counted(x, w, config, **fused):
        norm, gated, add = (fused.get(k) for k in ("norm", "gated", "add_to"))
        kinds.add((bool(norm), bool(gated), add is not None))
        return kernel(x, w, config, **fused)

    monkeypatch.setattr(skinny, "skinny_gemm", counted)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (700, 45, 1, 300)]
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    with torch.no_grad():
        want = run_steps_with_backend(model, TritonAttentionBackend(), prompts, 8)
        assert kinds <= {(False, False, False)}  # (off by default: plain skinny calls only)
        kinds.clear()
        for layer in model.model.layers:
            layer.fold_norms()
        for module in linears:
            module.fuse_neighbours = True
        got = run_steps_with_backend(model, TritonAttentionBackend(), prompts, 8)
    assert {(True, False, False), (True, True, False), (False, False, True)} <= kinds
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 2e-2, f"relative logits difference {rel:.2e}"


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
)
@pytest.mark.parametrize("name", ["flashinfer", "flashinfer_prefill"])
def test_flashinfer_on_the_qwen3_shape_bfloat16(tmp_path, name):
    """FlashInfer's wrappers (prefill chunks after cached context, a mixed step, decodes;
    head size 128, two query heads per KV head) on the same steps; or, as
    flashinfer_prefill, its prefill beside Triton's decodes."""
    from asyncllm.model.attention.flashinfer import FlashInferBackend
    from asyncllm.model.attention.flashinfer_prefill import FlashInferPrefillBackend

    backend = FlashInferBackend() if name == "flashinfer" else FlashInferPrefillBackend()
    _compare(_qwen3_shaped(tmp_path, "bfloat16"), QWEN3_06B["vocab_size"], 2e-2, backend)


@pytest.mark.skipif(
    not library_installed("flash_attn.cute"),
    reason="flash-attn-4 (the flash-attn extra) is not installed",
)
def test_flash_attention_on_the_qwen3_shape_bfloat16(tmp_path):
    """FlashAttention 4's varlen paged forward (the flash-attn extra) on the same steps."""
    from asyncllm.model.attention.flash_attn import FlashAttentionBackend

    backend = FlashAttentionBackend()
    _compare(_qwen3_shaped(tmp_path, "bfloat16"), QWEN3_06B["vocab_size"], 2e-2, backend)


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_smollm2(dtype, tol):
    from asyncllm.model.source import embedded_gguf_path

    try:
        embedded_gguf_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    model = load_model(
        create_model_config(EngineArgs(device="cuda", dtype=dtype)), TorchNativeBackend()
    )
    _compare(model, 49152, tol)


def test_engine_picks_triton_on_cuda():
    from asyncllm.model.attention.registry import select_attention_backend
    from asyncllm.model.attention.triton_attn import TritonAttentionBackend

    assert isinstance(select_attention_backend(torch.device("cuda:0")), TritonAttentionBackend)
    native = select_attention_backend(torch.device("cuda:0"), "torch_native")
    assert isinstance(native, TorchNativeBackend)
