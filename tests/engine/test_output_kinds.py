"""Streaming through LLMEngine: output kinds, deltas, incremental detokenization, aborts."""

from __future__ import annotations

import pytest

from asyncllm import RequestOutputKind, SamplingParams
from asyncllm.frontend.detokenizer import IncrementalDetokenizer

PROMPTS = [
    "日本語で自己紹介をしてください。",
    "Describe your favourite emoji 🎉🐍 and why:",
    "Count: one, two,",
]


def _run(engine, params):
    outs: dict[str, list] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"kind-{params.output_kind.name}-{i}", p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


GREEDY40 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def final_texts(llm) -> list[str]:
    """LLM.generate's texts for PROMPTS (one run for every kind)."""
    outs = llm.generate([{"prompt": p} for p in PROMPTS], GREEDY40, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(llm, final_texts, kind):
    params = GREEDY40.clone(output_kind=kind)
    outs = _run(llm.engine, params)
    tok = llm.get_tokenizer()
    for i, stream in enumerate(sorted(outs.values(), key=lambda s: s[0].request_id)):
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        last = stream[-1].outputs[0]
        ids = last.token_ids
        if kind is RequestOutputKind.DELTA:
            ids = [t for o in stream for t in o.outputs[0].token_ids]
        # A character cut off by max_tokens can never complete: it is dropped, not shown as U+FFFD.
        want_text = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        deltas = "".join(o.outputs[0].delta for o in stream)
        assert deltas == want_text
        assert all("\ufffd" not in o.outputs[0].delta for o in stream)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(stream) == 1 and last.text == want_text
        elif kind is RequestOutputKind.CUMULATIVE:
            assert len(stream) > 1 and last.text == want_text and len(last.token_ids) == 40
            assert all(
                o.outputs[0].text.startswith(prev.outputs[0].text)
                for prev, o in zip(stream, stream[1:])
            )
        else:
            assert len(stream) > 1
            assert "".join(o.outputs[0].text for o in stream) == want_text
            assert sum(len(o.outputs[0].token_ids) for o in stream) == 40
        assert want_text == final_texts[i]


def test_abort_ends_a_stream_and_frees_its_blocks(llm):
    engine = llm.engine
    engine.add_request(
        "to-abort",
        "Tell me everything about the sea.",
        SamplingParams(max_tokens=200, ignore_eos=True),
    )
    engine.add_request(
        "to-keep", "Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    engine.abort_request("to-abort")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    assert "to-abort" not in finished and len(finished["to-keep"].outputs[0].token_ids) == 5
    assert engine.step() == []  # nothing unfinished: returns at once, never waits
    stats = llm.get_stats()  # answered after the core has handled the abort
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_stop_string_is_held_back_while_it_may_still_match(llm):
    tok = llm.get_tokenizer()
    det = IncrementalDetokenizer(tok, [], stop=["STOP"])
    ids = tok("hello ST").input_ids
    det.update(ids)
    assert det.output_text.endswith("ST") and det.holdback() == 2
    det.update(tok("OP now").input_ids)
    assert det.stop_string == "STOP" and det.output_text == "hello "


def test_incremental_detokenization_never_shows_partial_characters(llm):
    tok = llm.get_tokenizer()
    text = "東京タワー🗼と富士山🗻、そして絵文字👩‍👩‍👧‍👦の家族。"
    ids = tok(text).input_ids
    det = IncrementalDetokenizer(tok, [])
    pieces = []
    for t in ids:
        before = det.output_text
        det.update([t])
        pieces.append(det.output_text[len(before) :])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == det.output_text
