"""LLM.generate's greedy outputs equal transformers' generate under every scheduling regime.

Sixteen prompts of 1 to 300 tokens, 24 new tokens each (EOS ignored on both sides),
compared under DESIGN.md's tie rule. Each regime exercises a different path: the
defaults, small token budgets (chunked prefill mixed with decodes), two sequences at a
time without the prefix cache (on four of the prompts: it takes a step per token), and
a KV cache so small that requests get preempted, and speculative decoding (async
scheduling on; off with the small KV cache).
"""

from __future__ import annotations

import pytest

from asyncllm import LLM, SamplingParams
from tests.model.helpers import assert_greedy_parity

# (disable_by_batch_size above the 16 prompts: every request drafts)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 32}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

REGIMES = {
    "defaults": {},
    "budget64": {"max_num_batched_tokens": 64},
    "two_seqs_no_prefix_cache": {"max_num_seqs": 2, "enable_prefix_caching": False},
    "tiny_kv_cache": {"max_model_len": 512, "num_gpu_blocks_override": 40},
    # drafts by prompt lookup verified in one pass (the outputs must not change)
    "speculative": {"speculative_config": SPEC},
    "speculative_sync_tiny_kv_cache": {
        "speculative_config": SPEC,
        "async_scheduling": False,
        "max_model_len": 512,
        "num_gpu_blocks_override": 40,
    },
}


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_defaults(llm, smollm_prompts16, hf_greedy_cache):
    outs = llm.generate([{"prompt_token_ids": p} for p in smollm_prompts16], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == smollm_prompts16  # input order kept
    assert all(o.outputs[0].finished() and o.outputs[0].finish_reason == "length" for o in outs)
    assert_greedy_parity(hf_greedy_cache, smollm_prompts16, _tokens(outs), "defaults")


@pytest.mark.parametrize("regime", [r for r in REGIMES if r != "defaults"])
def test_regime(regime, smollm_prompts16, hf_greedy_cache):
    # The core in this process: these check scheduling regimes, not the transport (the
    # shared `llm` fixture covers the default, separate process).
    two = regime.startswith("two_seqs")
    prompts = smollm_prompts16[::4] if two else smollm_prompts16
    with LLM(device="cpu", multiprocess=False, **REGIMES[regime]) as engine:
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = engine.get_stats()
    assert_greedy_parity(hf_greedy_cache, prompts, _tokens(outs), regime)
    if regime == "budget64":
        assert stats["num_chunked_prefill_steps"] > 0, stats
        assert stats["num_mixed_steps"] > 0, stats
    if two:
        assert stats["num_steps"] >= len(prompts) * 24 // 2
        assert stats["prefix_cache_queries"] == 0
    if regime.endswith("tiny_kv_cache"):
        assert stats["num_preemptions"] > 0, stats
    if regime.startswith("speculative"):
        assert stats["spec_num_accepted_tokens"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_prefix_cache_second_pass_hits_and_matches(llm, smollm_tokenizer):
    from tests.conftest import LONG_TEXT

    prefix = smollm_tokenizer(LONG_TEXT * 3).input_ids[:150]
    assert len(prefix) == 150
    prompts = [
        prefix + smollm_tokenizer(f" Question {i}: what comes next?").input_ids for i in range(4)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hits_before = llm.get_stats()["prefix_cache_hits"]
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 144 for o in second)  # the whole shared prefix, in blocks
    assert all(
        o.num_cached_tokens % 16 == 0 and o.num_cached_tokens < len(p)
        for o, p in zip(second, prompts)
    )
    assert llm.get_stats()["prefix_cache_hits"] > hits_before
    assert _tokens(first) == _tokens(second)
