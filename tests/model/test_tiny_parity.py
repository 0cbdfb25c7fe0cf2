"""Each supported architecture, tiny and random, equals transformers through the paged cache."""

from __future__ import annotations

import pytest
import torch

from asyncllm.config import EngineArgs
from asyncllm.engine.core_config import create_model_config
from asyncllm.model.attention.torch_native import TorchNativeBackend
from asyncllm.model.interface import KVCacheSpec
from asyncllm.model.loader import load_model
from tests.model.helpers import assert_greedy_parity, greedy_batch, hf_greedy
from tests.model.paged_decoder import PagedDecoder
from tests.model.tiny import ARCHS, make_tiny_model

PROMPT_LENS = [1, 7, 33, 100, 190, 300]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = make_tiny_model(request.param, folder)
    cfg = create_model_config(EngineArgs(model=str(folder), device="cpu"))
    ours = load_model(cfg, TorchNativeBackend())
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, cfg.hf_config.vocab_size, (n,), generator=gen).tolist()
        for n in PROMPT_LENS
    ]
    return request.param, ref, ours, prompts


def test_architecture_is_the_expected_class(tiny_pair):
    arch, _, ours, _ = tiny_pair
    expected = {
        "llama3": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3-moe": "Qwen3MoeForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
    }[arch]
    assert type(ours).__name__ == expected
    spec = ours.model.layers[0].self_attn.spec
    assert spec.sliding_window == (48 if arch in ("mistral", "gemma2", "gemma3") else None)
    if arch.startswith("gemma"):  # the second layer is global
        assert ours.model.layers[1].self_attn.spec.sliding_window is None
        assert spec.logits_soft_cap == (50.0 if arch == "gemma2" else None)
    if arch in ("qwen3", "gemma2", "gemma3"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_kv_cache_spec_follows_the_config(tiny_pair):
    _, _, ours, _ = tiny_pair
    cfg = ours.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    spec = ours.kv_cache_spec()
    assert spec == KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head)
    # K and V, per token of a block, per layer.
    assert spec.block_bytes(16, torch.bfloat16) == spec.num_layers * 2 * 16 * (
        spec.num_kv_heads * head * 2
    )


def test_prompt_and_decode_logits(tiny_pair):
    arch, ref, ours, prompts = tiny_pair
    prompt = prompts[4]
    ref_tokens, _ = hf_greedy(ref, prompt, 32)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt + ref_tokens])).logits[0]
    dec = PagedDecoder(ours, TorchNativeBackend(), num_blocks=32)
    sid = dec.add_sequence()
    worst = [
        (dec.step({sid: prompt}, all_logits=True)[sid] - ref_logits[: len(prompt)])
        .abs()
        .max()
        .item()
    ]
    for i, token in enumerate(ref_tokens):
        got = dec.step({sid: [token]})[sid][0]
        worst.append((got - ref_logits[len(prompt) + i]).abs().max().item())
    assert max(worst) <= 1e-3, f"{arch}: max |Δlogit| per step {worst}"


# (the windowed models' greedy parity runs through the whole engine instead:
# tests/model/test_windowed_models.py)
@pytest.mark.parametrize(
    "tiny_pair", [a for a in ARCHS if not a.startswith("gemma")], indirect=True
)
def test_greedy_matches_generate(tiny_pair):
    arch, ref, ours, prompts = tiny_pair
    dec = PagedDecoder(ours, TorchNativeBackend(), num_blocks=128)
    got = greedy_batch(dec, prompts, 32, chunk_size=64)
    assert_greedy_parity(ref, prompts, got, arch)
