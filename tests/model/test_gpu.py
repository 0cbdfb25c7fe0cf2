"""The model on a CUDA device: float32 parity with transformers, bfloat16 within tolerance."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.loader import load_model
from tests.model.helpers import greedy_batch, hf_greedy
from tests.model.paged_decoder import PagedDecoder
from tests.model.tiny import ARCHS, make_tiny_model

pytestmark = pytest.mark.gpu


def _ours_and_ref(folder, dtype):
    from transformers import AutoModelForCausalLM

    cfg = create_model_config(EngineArgs(model=str(folder), device="cuda", dtype=dtype))
    ours = load_model(cfg, TorchNativeBackend())
    # (eager attention: the exact reference; SDPA drops Gemma 2's logit soft-capping)
    ref = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    ref = ref.cuda().eval()
    return ours, ref


def _paged_logits(model, tokens):
    dec = PagedDecoder(model, TorchNativeBackend(), num_blocks=64)
    sid = dec.add_sequence()
    return dec.step({sid: tokens}, all_logits=True)[sid]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_models_on_cuda(tmp_path, arch, dtype):
    """float32: equal to transformers within 1e-4 (relative). bfloat16: no further from
    transformers' float32 logits than transformers' own bfloat16 run is (plus 0.5%)."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(arch, tmp_path)
    ours, ref = _ours_and_ref(tmp_path, dtype)
    tokens = torch.randint(0, 384, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    got = _paged_logits(ours, tokens)
    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        want = ref(ids).logits[0].float()
    rel = ((got - want).norm() / want.norm()).item()
    if dtype == "float32":
        assert rel <= 1e-4, f"{arch}: relative logits error {rel:.2e}"
    else:
        ref16 = AutoModelForCausalLM.from_pretrained(
            str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager"
        ).cuda()
        with torch.no_grad():
            ref16_logits = ref16.eval()(ids).logits[0].float()
        ref_rel = ((ref16_logits - want).norm() / want.norm()).item()
        assert rel <= 1.5 * ref_rel + 5e-3, (
            f"{arch}: ours {rel:.2e}, transformers bf16 {ref_rel:.2e}"
        )
    assert next(ours.parameters()).device.type == "cuda"


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_smollm_bfloat16_on_cuda():
    from transformers import AutoModelForCausalLM

    from asyncllm.model.source import embedded_gguf_path

    try:
        path = embedded_gguf_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    cfg = create_model_config(EngineArgs(device="cuda"))
    assert cfg.dtype == torch.bfloat16
    ours = load_model(cfg, TorchNativeBackend())
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ref = ref.cuda().eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 60, 250)]
    got = _paged_logits(ours, prompts[2])
    with torch.no_grad():
        want = ref(torch.tensor([prompts[2]], device="cuda")).logits[0].float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 2e-2, rel
    dec = PagedDecoder(ours, TorchNativeBackend(), num_blocks=128)
    ours_tokens = greedy_batch(dec, prompts, 16)
    agree = total = 0
    for prompt, tokens in zip(prompts, ours_tokens):
        ref_tokens, _ = hf_greedy(ref, prompt, 16)
        # Count agreement up to the first divergence (after it, the contexts differ).
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        agree, total = agree + n, total + len(tokens)
    assert agree / total >= 0.5, f"greedy agreement {agree}/{total}"
