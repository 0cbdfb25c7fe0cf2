"""Where generation ends: stop strings (even across tokens), stop tokens, min_tokens, lengths."""

from __future__ import annotations

import pytest

from asyncllm import LLM, SamplingParams

PROMPT = {"prompt": "The history of the Roman Empire begins"}


@pytest.fixture(scope="module", params=["async", "sync"])
def either(request, llm):
    """The shared engine (async scheduling: a stop found at step N must drop the token
    step N+1 computed meanwhile), and one stepping one step at a time; the second has no
    model (`InstantExecutor`: its tokens are a function of position), as stop strings and
    stop tokens need none."""
    if request.param == "async":
        yield llm
        return
    engine = LLM(
        device="cpu",
        async_scheduling=False,
        multiprocess=False,
        distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
    )
    yield engine
    engine.shutdown()


def _greedy(llm, n=40, **kw):
    return llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False
    )[0].outputs[0]


def _stop_across_tokens(llm):
    """A stop string that starts inside one token and ends inside the next."""
    tok = llm.get_tokenizer()
    full = _greedy(llm)
    pieces = [tok.decode([t]) for t in full.token_ids]
    for k in range(3, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if len(a) >= 2 and len(b) >= 2:
            stop = a[-2:] + b[:2]
            start = full.text.find(stop)
            if start >= 0 and full.text.find(stop) == len("".join(pieces[:k])) + len(a) - 2:
                return full, stop, start
    raise AssertionError("no stop string across two tokens found")


def test_stop_string_split_across_tokens(either):
    full, stop, start = _stop_across_tokens(either)
    out = _greedy(either, stop=[stop])
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = _greedy(either, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[: start + len(stop)]


def test_stop_token_ids(either):
    full = _greedy(either)
    token = full.token_ids[4]
    first = full.token_ids.index(token)
    out = _greedy(either, stop_token_ids=[token])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_back(llm):
    chat = {
        "prompt_token_ids": llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Say just: yes"}],
            add_generation_prompt=True,
            tokenize=True,
        )
    }
    if not isinstance(chat["prompt_token_ids"], list):
        chat["prompt_token_ids"] = chat["prompt_token_ids"]["input_ids"]
    eos = llm.get_tokenizer().eos_token_id
    short = llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=50), use_tqdm=False)[
        0
    ].outputs[0]
    assert (
        short.finish_reason == "stop" and short.token_ids[-1] == eos and len(short.token_ids) < 50
    )
    held = llm.generate(
        chat,
        SamplingParams(temperature=0.0, max_tokens=50, min_tokens=len(short.token_ids) + 5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(held.token_ids) >= len(short.token_ids) + 5
    assert eos not in held.token_ids[: len(short.token_ids) + 4]
    ignored = llm.generate(
        chat, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignored.token_ids) == 30 and ignored.finish_reason == "length"


def test_max_tokens_and_max_model_len_end_with_length():
    with LLM(device="cpu", max_model_len=64, multiprocess=False) as engine:
        prompt = {"prompt_token_ids": list(range(100, 160))}
        out = engine.generate(
            prompt,
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
            use_tqdm=False,
        )[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        out = engine.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), use_tqdm=False
        )[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
        # A prompt of exactly max_model_len tokens: accepted, one token (as in vLLM).
        exact = {"prompt_token_ids": list(range(100, 164))}
        out = engine.generate(exact, SamplingParams(temperature=0.0), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_blocks"]
