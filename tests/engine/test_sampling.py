"""Sampling through the whole engine: seeds, greedy equivalents, logprobs, n, user processors."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.engine.core_config import create_engine_config

PROMPT = {"prompt": "Write a short poem about the sea:"}


def _ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_same_seed_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    mixed = llm.generate(
        [{"prompt": "Hello there"}, PROMPT, {"prompt": "Numbers: 1, 2, 3,"}, PROMPT],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [PROMPT] * 3,
            SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    assert len({tuple(t) for t in unseeded} | {tuple(alone)}) > 1  # randomness is real


def test_temperature_zero_and_top_k_one_equal_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    top1 = llm.generate(
        PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=20, seed=3), use_tqdm=False
    )
    assert _ids(greedy) == _ids(top1)


def test_n_gives_n_completions(llm):
    out = llm.generate(
        PROMPT, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=5), use_tqdm=False
    )
    assert len(out) == 1
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in comps}) > 1
    assert all(c.finish_reason in ("stop", "length") for c in comps)


def test_logprobs_equal_log_softmax_of_transformers_logits(llm, hf_smollm):
    params = SamplingParams(
        temperature=0.7, seed=9, max_tokens=12, logprobs=5, prompt_logprobs=3, ignore_eos=True
    )
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    full = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([full])).logits[0].float().log_softmax(-1)
    P = len(out.prompt_token_ids)
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for i, (token, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[P - 1 + i]
        assert abs(lp[token].logprob - row[token].item()) <= 1e-4
        assert lp[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert t in lp and abs(lp[t].logprob - v) <= 1e-4
        total += lp[token].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for p in range(1, P):
        token = out.prompt_token_ids[p]
        assert abs(out.prompt_logprobs[p][token].logprob - ref[p - 1][token].item()) <= 1e-4


def test_user_logits_processor_by_import_path():
    with LLM(device="cpu", logits_processors=["tests.engine.processors:ForceToken"]) as engine:
        forced, plain = engine.generate(
            [PROMPT, PROMPT],
            [
                SamplingParams(temperature=0.0, max_tokens=6, extra_args={"force_token": 1234}),
                SamplingParams(temperature=0.0, max_tokens=6),
            ],
            use_tqdm=False,
        )
    assert forced.outputs[0].token_ids == [1234] * 6
    assert plain.outputs[0].token_ids != [1234] * 6


@pytest.mark.parametrize(
    "path,match",
    [
        ("tests.engine.processors:NotAProcessor", "not a LogitsProcessor"),
        ("tests.engine.nowhere:X", "cannot import"),
        ("justaname", "form"),
    ],
)
def test_bad_logits_processor_paths_are_named(path, match):
    from asyncllm import EngineArgs

    with pytest.raises(ValueError, match=match):
        create_engine_config(EngineArgs(device="cpu", logits_processors=[path]))


def test_penalties_and_bias_change_what_is_chosen(llm):
    base = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[
        0
    ].outputs[0]
    first = base.token_ids[0]
    biased = llm.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=10, logit_bias={first: -100.0}),
        use_tqdm=False,
    )[0].outputs[0]
    assert biased.token_ids[0] != first
    rep = llm.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=2.0, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    plain = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(set(rep.token_ids)) >= len(set(plain.token_ids))
    assert rep.token_ids != plain.token_ids
