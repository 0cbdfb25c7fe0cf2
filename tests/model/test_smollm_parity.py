"""SmolLM2-135M-Instruct through the paged cache equals transformers reading the GGUF."""

from __future__ import annotations

import torch

from asyncllm.model.attention.torch_native import TorchNativeBackend
from tests.model.helpers import assert_greedy_parity, greedy_batch
from tests.model.paged_decoder import PagedDecoder


def test_prompt_and_24_decode_steps_match_reference_logits(
    smollm_model, hf_smollm, hf_greedy_cache, smollm_prompts
):
    prompt = smollm_prompts[3]  # the chat turn
    ref_tokens, _ = hf_greedy_cache(prompt, 24)
    full = prompt + ref_tokens
    with torch.no_grad():
        ref_logits = hf_smollm(torch.tensor([full])).logits[0].float()

    dec = PagedDecoder(smollm_model, TorchNativeBackend(), num_blocks=64)
    sid = dec.add_sequence()
    logits = dec.step({sid: prompt}, all_logits=True)[sid]
    worst = [(logits - ref_logits[: len(prompt)]).abs().max().item()]
    for i, token in enumerate(ref_tokens):  # teacher-forced: the reference's own tokens
        step_logits = dec.step({sid: [token]})[sid][0]
        worst.append((step_logits - ref_logits[len(prompt) + i]).abs().max().item())
    assert len(worst) == 25
    assert max(worst) <= 1e-3, f"max |Δlogit| per step: {worst}"
    dec.free(sid)
    assert dec.num_free_blocks == 64


def test_greedy_continuations_match_generate(smollm_model, hf_greedy_cache, smollm_prompts16):
    # The engine tests' sixteen prompts: transformers answers them once for the session.
    dec = PagedDecoder(smollm_model, TorchNativeBackend(), num_blocks=256)
    ours = greedy_batch(dec, smollm_prompts16, 24)
    assert dec.num_free_blocks == 256
    assert_greedy_parity(hf_greedy_cache, smollm_prompts16, ours, "SmolLM2")
