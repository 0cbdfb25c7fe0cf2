"""The decoder layers' fused small-batch flow (layers/linear.py: a linear layer's launch
taking in the RMSNorm before it, the gate or the residual add after it) on the CPU.

The skinny GEMM kernel runs only on CUDA (its GPU tests: tests/kernels/
test_skinny_gemm.py, tests/model/test_gpu_triton.py), so here each fused call is done by
the plain-torch references, in float32: what is checked is the flow around it (the
norms' weights folded into the projections after them, which projection takes which
neighbour, the residual stream handed over as None, the final norm, the
mixture-of-experts and latent-attention layers beside it, prefill chunks through the
folded weights apart), against the same model as loaded with every launch apart."""

from __future__ import annotations

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.mla import MLABackend
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.layers.linear import LinearBase
from asyncllm.model.layers.norm import PendingNorm, RMSNorm
from asyncllm.model.loader import load_model
from asyncllm_kernels.reference import rms_norm_ref, silu_and_mul_ref
from tests.model.helpers import run_steps_with_backend
from tests.model.tiny import make_tiny_model


def _emulated(calls: list[tuple[bool, bool, bool]]):
    """LinearBase._small_batch done in torch, for batches of at most 16 rows."""

    def small_batch(self, x, gated=False, add_to=None):
        pending = x if isinstance(x, PendingNorm) else None
        t = pending.residual if pending is not None else x
        if t.shape[0] > 16 or self.bias is not None:
            return None
        if pending is not None:
            if not pending.norm.folded:
                return None
            assert torch.equal(pending.norm.weight, torch.ones_like(pending.norm.weight))
            t = rms_norm_ref(pending.stream(), pending.norm.weight, pending.norm.eps)
        calls.append((pending is not None, gated, add_to is not None))
        y = self._matmul(t, None)
        if gated:
            y = silu_and_mul_ref(y)
        return y if add_to is None else add_to.add_(y)

    return small_batch


@pytest.mark.parametrize(
    "arch,kinds",
    [
        # every projection fused: qkv and gate/up take the norms, o_proj and down the adds
        ("llama3", {(True, False, False), (False, False, True), (True, True, False)}),
        ("qwen3", {(True, False, False), (False, False, True), (True, True, False)}),
        # the experts' layer takes a normalized tensor; its dense layer fuses as Llama's
        ("qwen3-moe", {(True, False, False), (False, False, True), (True, True, False)}),
        # latent attention apart; the dense MLP and the shared experts gated
        ("deepseek-v2", {(True, True, False), (False, False, True), (False, True, False)}),
    ],
)
def test_the_fused_flow_equals_every_launch_apart(tmp_path, monkeypatch, arch, kinds):
    monkeypatch.setenv("ASYNCLLM_CPU_PACKING", "0")  # (the weights to fold stay in place)
    make_tiny_model(arch, tmp_path)
    args = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32")
    backend = MLABackend() if arch.startswith("deepseek") else TorchNativeBackend()
    model = load_model(create_model_config(args), backend)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (40, 7, 1, 25)]
    with torch.no_grad():
        want = run_steps_with_backend(model, backend, prompts, 4)
        for layer in model.model.layers:
            layer.fold_norms()
        calls: list[tuple[bool, bool, bool]] = []
        monkeypatch.setattr(LinearBase, "_small_batch", _emulated(calls))
        got = run_steps_with_backend(model, backend, prompts, 4)
    assert set(calls) == kinds
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def test_a_pending_norm_adds_its_x_into_the_residual_once():
    """Whichever way it is used, and however often, the residual gains x once."""
    norm = RMSNorm(8)
    for use in ("stream", "resolve"):
        x, residual = torch.ones(2, 8), torch.full((2, 8), 2.0)
        pending = PendingNorm.of(norm, x, residual)
        getattr(pending, use)()
        assert torch.equal(pending.stream(), torch.full((2, 8), 3.0)) and pending.x is None
        assert torch.equal(residual, torch.full((2, 8), 3.0))
    first = torch.full((1, 8), 5.0)  # (the first layer: its input is the stream)
    assert PendingNorm.of(norm, first, None).stream() is first
