"""Tools in chat on the embedded SmolLM2: its template ignores `tools` and breaks on an
assistant turn that only calls tools, so the Hermes-style fallback renders them; a
forced call ('required' or a named function) is a valid call for the tool's schema,
through LLM.chat and a streamed AsyncLLM.chat."""

from __future__ import annotations

import json

import jinja2
import pytest

from asyncllm import RequestOutputKind, SamplingParams
from asyncllm.frontend.chat_tools import HERMES_TEMPLATE, template_uses_tools
from tests.tool_defs import ASK, TOOLS

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def _check_call(call, tools=TOOLS):
    (fn,) = [t["function"] for t in tools if t["function"]["name"] == call.name]
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_smollm_template_ignores_tools_so_the_fallback_renders_them(llm, smollm_tokenizer):
    assert not template_uses_tools(smollm_tokenizer)
    call = {"type": "function", "function": {"name": "clock", "arguments": {"timezone": "UTC"}}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises((TypeError, jinja2.TemplateError)):  # its own template breaks
        smollm_tokenizer.apply_chat_template(turn, tools=TOOLS, tokenize=False)
    ids = llm.engine.frontend.chat_prompt(
        [*turn, {"role": "tool", "content": "12:00"}], tools=TOOLS
    )["prompt_token_ids"]
    text = smollm_tokenizer.decode(ids)
    assert "<tools>" in text and '"calculator"' in text and '"clock"' in text
    assert '<tool_call>\n{"name": "clock", "arguments": {"timezone": "UTC"}}' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    direct = smollm_tokenizer.apply_chat_template(
        [*turn], tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False
    )
    assert direct in text  # (the same template, rendered by the tokenizer itself)


def test_tool_turns_without_tools_still_render_through_the_fallback(llm, smollm_tokenizer):
    # (an agent answering after a call, with tool_choice 'none' or no tools at all)
    call = {"type": "function", "function": {"name": "clock", "arguments": "{}"}}
    conv = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12:00"},
    ]
    text = smollm_tokenizer.decode(llm.engine.frontend.chat_prompt(conv)["prompt_token_ids"])
    assert '<tool_call>\n{"name": "clock", "arguments": {}}' in text and "<tools>" not in text
    (out,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out.outputs[0].text


def test_required_and_named_tool_choice_force_a_valid_call(llm):
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")
    (call,) = out.outputs[0].tool_calls
    _check_call(call)
    assert out.outputs[0].text == ""
    named = {"type": "function", "function": {"name": "clock"}}
    (out,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice=named)
    (call,) = out.outputs[0].tool_calls
    assert call.name == "clock"
    _check_call(call)


def test_tool_choice_none_renders_no_tools_and_parses_nothing(llm):
    (out,) = llm.chat(
        ASK,
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
        tools=TOOLS,
        tool_choice="none",
    )
    assert out.outputs[0].tool_calls is None


def test_bad_tools_and_tool_choice_are_clear_errors(llm):
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat(
            ASK, GREEDY, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat(ASK, GREEDY, tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(TypeError, match="tools"):
        llm.chat(ASK, GREEDY, tools=[{"name": "calculator"}])
    forced = SamplingParams(max_tokens=4, structured_outputs=None)
    (out,) = llm.chat(ASK, forced, use_tqdm=False)  # the engine serves on
    assert out.finished


@pytest.mark.asyncio(loop_scope="session")
async def test_async_chat_streams_text_then_the_parsed_call(allm):
    params = SamplingParams(temperature=0.0, max_tokens=48, output_kind=RequestOutputKind.DELTA)
    outs = [o async for o in allm.chat(ASK, params, tools=TOOLS, tool_choice="required")]
    assert len(outs) > 1 and all(o.outputs[0].tool_calls is None for o in outs[:-1])
    text = "".join(o.outputs[0].text for o in outs)
    (call,) = outs[-1].outputs[0].tool_calls
    _check_call(call)
    assert json.loads(text) == {"name": call.name, "arguments": json.loads(call.arguments)}


@pytest.mark.asyncio(loop_scope="session")
async def test_async_chat_with_n2_delta_gives_each_completion_its_call(allm):
    """n = 2 in DELTA: the children end in different outputs, and each completion gets
    its parsed call in the output where it ends."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=48, output_kind=RequestOutputKind.DELTA
    )
    calls = {}
    async for out in allm.chat(ASK, params, tools=TOOLS, tool_choice="required"):
        for c in out.outputs:
            if c.tool_calls:
                assert c.finish_reason is not None and c.index not in calls
                calls[c.index] = c.tool_calls
    assert sorted(calls) == [0, 1]
    for (call,) in calls.values():
        _check_call(call)
