"""Bad input is rejected with an error naming the field, and the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.engine.llm_engine import LLMEngine


@pytest.mark.parametrize(
    "kwargs,error,field",
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"min_p": 2.0}, ValueError, "min_p"),
        ({"n": 0}, ValueError, "n"),
        ({"n": 2.0}, TypeError, "n"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, ValueError, "min_tokens"),
        ({"stop": ""}, ValueError, "stop"),
        ({"stop": ["ok", ""]}, ValueError, "stop"),
        ({"stop": 3}, TypeError, "stop"),
        ({"stop_token_ids": ["a"]}, TypeError, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
        ({"presence_penalty": 3.0}, ValueError, "presence_penalty"),
        ({"logit_bias": {"a": 1.0}}, TypeError, "logit_bias"),
        ({"logprobs": -1}, ValueError, "logprobs"),
        ({"seed": "x"}, TypeError, "seed"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_an_output_kind_set_as_an_int_later_is_checked_as_the_enum():
    from asyncllm import RequestOutputKind

    params = SamplingParams()
    params.output_kind = 1  # (DELTA, set after construction)
    params.verify()
    assert params.output_kind is RequestOutputKind.DELTA
    params.output_kind = 7
    with pytest.raises(ValueError, match="output_kind"):
        params.verify()


@pytest.mark.parametrize(
    "prompt,error,match",
    [
        ("", ValueError, "empty"),
        ([], ValueError, "empty"),
        ({"prompt_token_ids": []}, ValueError, "empty"),
        ({"prompt_token_ids": [1, 49152]}, ValueError, "token id 49152"),
        ({"prompt_token_ids": [1, -1]}, ValueError, "token id -1"),
        ({"prompt_token_ids": [1, "2"]}, TypeError, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(1, 9000))}, ValueError, "max_model_len"),
        ({"text": "hi"}, ValueError, "unknown keys"),
        (3.5, TypeError, "prompt"),
    ],
)
def test_bad_prompts_name_the_problem_and_the_engine_keeps_serving(llm, prompt, error, match):
    with pytest.raises(error, match=match):
        llm.generate([{"prompt": "fine"}, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0  # the good one never started
    out = llm.generate(
        "Still working?", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_params_against_the_model(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("x", SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate("x", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(device="cpu", max_num_seq=4)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_kv_cache_too_small_for_one_request_is_a_clear_error(multiprocess):
    from asyncllm import EngineStartupError

    with pytest.raises(EngineStartupError, match="max_model_len") as info:
        LLM(device="cpu", max_model_len=1024, num_gpu_blocks_override=10, multiprocess=multiprocess)
    assert info.value.__cause__ is not None  # (in-process: the ValueError; else the core's death)


def test_duplicate_request_id_is_rejected(llm):
    engine: LLMEngine = llm.engine
    engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_request_the_in_process_core_refuses_raises_and_leaves_nothing_waiting(monkeypatch):
    """The frontend's checks passed, the core's did not (a mismatch between the two, or a
    check only the core can make): generate raised nothing and waited forever once."""
    with LLM(device="cpu", max_model_len=64, multiprocess=False) as engine:
        core = engine.engine.client.core
        check = core._check_request

        def refuse_second_child(req):
            if req.request_id.startswith("1_"):
                raise ValueError("refused by the core")
            return check(req)

        monkeypatch.setattr(core, "_check_request", refuse_second_child)
        with pytest.raises(ValueError, match="refused by the core"):
            engine.generate([1, 2, 3], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
        assert not engine.engine.has_unfinished_requests()
        stats = engine.get_stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        out = engine.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
