"""Speculative decoding on the embedded SmolLM2 (float32, CPU) through `LLM`: the
request features that pass the frontend give what they give without drafts: n > 1
seeded samples, logprobs and prompt logprobs (within 1e-4), stop strings; on a prompt
that asks the model to repeat a passage, most drafts are accepted; constrained requests
draft (their grammars check the drafts), stay valid and give what they give without."""

from __future__ import annotations

import json
import math
import re

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.sampling_params import StructuredOutputsParams as S
from tests.engine.test_structured_outputs import (
    CHOICES,
    GRAMMAR,
    PROMPT,
    REGEXES,
    SCHEMAS,
    _check_json,
    _json_params,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "disable_by_batch_size": 16}  # fmt: skip
PASSAGE = (
    "def area(r):\n    return 3.14159 * r * r\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"
)


@pytest.fixture(scope="module")
def spec_llm():
    with LLM(device="cpu", multiprocess=False, speculative_config=SPEC) as engine:
        yield engine


def _close(a, b) -> bool:
    return math.isclose(a, b, abs_tol=1e-4)


def _same_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:
            assert g is w is None
            continue
        assert g.keys() == w.keys()
        for t in w:
            assert _close(g[t].logprob, w[t].logprob) and g[t].rank == w[t].rank


def test_features_equal_speculation_off(llm, spec_llm, smollm_tokenizer):
    chat = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this code exactly:\n\n{PASSAGE}"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    cases = [
        ({"prompt": chat}, SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)),
        (
            {"prompt": chat},
            SamplingParams(temperature=0.8, top_p=0.95, seed=11, n=2, max_tokens=24),
        ),
        (
            {"prompt": "The days of the week are Monday, Tuesday,"},
            SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=2, stop=["Friday"]),
        ),
    ]
    before = spec_llm.get_stats()["spec_num_accepted_tokens"]
    for prompt, params in cases:
        (want,) = llm.generate([prompt], params, use_tqdm=False)
        (got,) = spec_llm.generate([prompt], params, use_tqdm=False)
        assert len(got.outputs) == len(want.outputs) == params.n
        for g, w in zip(got.outputs, want.outputs):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
            if params.logprobs is not None:
                _same_logprobs(g.logprobs, w.logprobs)
        if params.prompt_logprobs is not None:
            _same_logprobs(got.prompt_logprobs, want.prompt_logprobs)
    assert want.outputs[0].finish_reason == "stop"  # (the stop string was met)
    stats = spec_llm.get_stats()
    assert stats["spec_num_accepted_tokens"] > before
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_constrained_requests_stay_valid_beside_speculating_ones(spec_llm, smollm_tokenizer):
    """JSON schemas, regexes, a choice and a grammar in the same steps as a request that
    verifies drafts: each constrained output holds its constraint, and drafts are kept."""
    params = [_json_params(s, temperature=0.0) for s in SCHEMAS[:6]]
    params += [SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=S(regex=r))
               for r in REGEXES[:3]]  # fmt: skip
    params.append(SamplingParams(max_tokens=8, structured_outputs=S(choice=CHOICES)))
    params.append(SamplingParams(max_tokens=16, structured_outputs=S(grammar=GRAMMAR)))
    repeat = smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this code exactly:\n\n{PASSAGE}"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [PROMPT] * len(params) + [repeat]
    params.append(SamplingParams(temperature=0.0, max_tokens=40))
    before = spec_llm.get_stats()["spec_num_accepted_tokens"]
    texts = [o.outputs[0].text for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    for text, schema in zip(texts, SCHEMAS[:6]):
        _check_json(text, schema)
    for text, regex in zip(texts[6:9], REGEXES[:3]):
        assert re.fullmatch(regex, text), (regex, text)
    assert texts[9] in CHOICES
    assert re.fullmatch(r"The answer is [0-9]\.", texts[10])
    stats = spec_llm.get_stats()
    assert stats["spec_num_accepted_tokens"] > before
    assert stats["num_free_blocks"] == stats["num_blocks"]


RECORD = {
    "name": "Ada Lovelace",
    "city": "London",
    "born": 1815,
    "languages": ["English", "French"],
}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "born": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "born", "languages"],
    "additionalProperties": False,
}


def test_constrained_requests_draft_and_give_what_they_give_without(
    llm, spec_llm, smollm_tokenizer
):
    """Constrained requests whose output is mostly in their prompt draft it: each draft
    is checked by its grammar (a row of the bitmask per draft position), drafts are
    kept, and the outputs, greedy and seeded, are the ones they are without drafts."""

    def chat(text: str) -> str:
        return smollm_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )

    prompts = [
        chat(f"Write this record as JSON, exactly as it is: {json.dumps(RECORD)}"),
        chat(f"Write this record as JSON, exactly as it is: {json.dumps(RECORD)}"),
        chat("Repeat this number: 31415926535897932384"),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=S(json=RECORD_SCHEMA)),
        SamplingParams(
            temperature=0.7, seed=3, max_tokens=60, structured_outputs=S(json=RECORD_SCHEMA)
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=S(regex="[0-9]{20}")),
    ]
    want = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    before = spec_llm.get_stats()["spec_num_accepted_tokens"]
    got = [o.outputs[0] for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert spec_llm.get_stats()["spec_num_accepted_tokens"] - before >= 10
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    _check_json(got[0].text, RECORD_SCHEMA)
    _check_json(got[1].text, RECORD_SCHEMA)
    assert re.fullmatch("[0-9]{20}", got[2].text)
    stats = spec_llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_constrained_requests_that_draft_survive_preemption(llm, smollm_tokenizer):
    """Seven constrained requests that draft, in a KV cache of 20 blocks: they preempt
    each other mid-speculation (their matchers are rebuilt from the tokens they kept);
    every output is the one it is without drafts or preemption, every block comes back."""

    def chat(text: str) -> str:
        return smollm_tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )

    records = [dict(RECORD, born=1815 + i) for i in range(4)]
    prompts = [
        chat(f"Write this record as JSON, exactly as it is: {json.dumps(r)}") for r in records
    ]
    prompts += [chat(f"Repeat this number: {31415926535897932384 + 7 * i}") for i in range(3)]
    as_json = S(json=RECORD_SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=as_json)] * 4
    digits = S(regex="[0-9]{20}")
    params += [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=digits)] * 3
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    small = dict(max_model_len=256, num_gpu_blocks_override=20)
    with LLM(device="cpu", multiprocess=False, speculative_config=SPEC, **small) as tight:
        got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
        stats = tight.get_stats()
    assert got == want
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    for text in got[:4]:
        _check_json(text, RECORD_SCHEMA)
