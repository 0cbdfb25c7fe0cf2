"""Tool calls parsed from fixed model outputs: the Hermes/Qwen block style, plain JSON,
and malformed text (plain content, no calls, no exception)."""

from __future__ import annotations

import json

import pytest

from asyncllm.frontend.tool_calls import ToolCallStream, parse_tool_calls


def _plain(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_one_hermes_block_with_text_around_it():
    text = 'Let me check.\n<tool_call>\n{"name": "clock", "arguments": {"tz": "UTC"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert _plain(calls) == [("clock", {"tz": "UTC"})]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"


def test_two_hermes_blocks_get_distinct_ids_and_keep_order():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "clock", "parameters": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == ""
    assert _plain(calls) == [("add", {"a": 1, "b": 2}), ("clock", {})]
    assert calls[0].id != calls[1].id


def test_an_unclosed_last_block_is_still_a_call():
    content, calls = parse_tool_calls('<tool_call>{"name": "clock", "arguments": {}}')
    assert content == "" and _plain(calls) == [("clock", {})]


def test_arguments_as_a_json_string_are_kept():
    _, calls = parse_tool_calls('{"name": "add", "arguments": "{\\"a\\": 1}"}')
    assert calls[0].arguments == '{"a": 1}'


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "calc", "arguments": {"expr": "2+2"}}', [("calc", {"expr": "2+2"})]),
        (
            ' [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}] ',
            [("a", {}), ("b", {"x": [1]})],
        ),
    ],
)
def test_plain_json_calls(text, expected):
    content, calls = parse_tool_calls(text)
    assert content == "" and _plain(calls) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The time is noon.",
        "",
        "{not json at all",
        '{"name": 3, "arguments": {}}',
        '{"arguments": {"a": 1}}',
        '{"name": "calc", "arguments": [1, 2]}',
        '{"name": "calc", "arguments": "not json"}',
        "[]",
        '[{"name": "a", "arguments": {}}, "stray"]',
        '{"answer": 42}',
        "<tool_call>{broken</tool_call> and prose",
        "<tool_call></tool_call>",
    ],
)
def test_malformed_output_is_plain_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_stays_beside_a_good_one():
    text = '<tool_call>{oops}</tool_call> then <tool_call>{"name": "clock", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert _plain(calls) == [("clock", {})]
    assert content == "<tool_call>{oops}</tool_call> then"


def _stream(pieces):
    s = ToolCallStream()
    sent = [s.feed(p) for p in pieces]
    rest, calls = s.finish()
    return sent, rest, calls


def test_a_stream_sends_content_as_it_comes_and_holds_back_a_call():
    text = 'Let me check. <tool_call>{"name": "clock", "arguments": {"tz": "UTC"}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the marker split up
    sent, rest, calls = _stream(pieces)
    assert "".join(sent) == "Let me check. " and rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("clock", {"tz": "UTC"})]
    assert all("<" not in s for s in sent)


def test_a_stream_of_plain_json_waits_for_the_end():
    sent, rest, calls = _stream(["  ", '{"name": "f", ', '"arguments": {}}'])
    assert sent == ["", "", ""] and rest == "" and [c.name for c in calls] == ["f"]


def test_a_stream_without_calls_gives_all_its_text():
    for pieces in (["Hello", " <tool", "box> done"], ["<", "b>x"], ["{not json", "}"]):
        sent, rest, calls = _stream(pieces)
        assert "".join(sent) + rest == "".join(pieces) and calls == []


def test_a_malformed_call_in_a_stream_comes_back_as_content():
    sent, rest, calls = _stream(["ok ", "<tool_call>{broken", "</tool_call>"])
    assert calls == [] and "".join(sent) + rest == "ok <tool_call>{broken</tool_call>"


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Alice", "age": 30}',  # (a JSON answer about someone called Alice)
        '[{"name": "Alice"}, {"name": "Bob"}]',
        '{"name": "Alice", "arguments": {}, "age": 30}',
        '{"name": "calc"}',  # (plain JSON names its arguments: else it is an answer)
    ],
)
def test_a_json_answer_with_a_name_is_not_a_call(text):
    assert parse_tool_calls(text) == (text, [])


def test_plain_json_calls_only_name_the_declared_tools():
    text = '{"name": "Alice", "arguments": {}}'
    assert parse_tool_calls(text, names={"calc"}) == (text, [])
    _, calls = parse_tool_calls('{"name": "calc", "arguments": {}}', names={"calc"})
    assert _plain(calls) == [("calc", {})]
    _, calls = parse_tool_calls('<tool_call>{"name": "calc"}</tool_call>', names={"calc"})
    assert _plain(calls) == [("calc", {})]  # (a block's arguments may be left out)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "<tool_call>" + "[" * 5000,
        '{"name": "f", "arguments": ' + "[" * 5000,
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": "{\\"x\\": Infinity}"}',
        '{"name": "f", "arguments": "[1, 2]"}',
        '{"name": "f", "arguments": "null"}',
    ],
)
def test_deep_nesting_and_non_json_numbers_are_plain_text(text):
    assert parse_tool_calls(text) == (text, [])
    sent, rest, calls = _stream([text[:7], text[7:]])
    assert calls == [] and "".join(sent) + rest == text


def test_an_unclosed_malformed_block_does_not_hide_the_next_one():
    text = '<tool_call>{bad}\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert _plain(calls) == [("f", {})] and content == "<tool_call>{bad}"


def test_a_closing_tag_inside_an_argument_string_is_part_of_the_call():
    text = '<tool_call>{"name": "echo", "arguments": {"s": "a</tool_call>b"}}</tool_call> ok'
    content, calls = parse_tool_calls(text)
    assert _plain(calls) == [("echo", {"s": "a</tool_call>b"})] and content == "ok"


def test_text_after_a_blocks_json_makes_it_malformed():
    text = '<tool_call>{"name": "f", "arguments": {}} trailing words</tool_call>'
    assert parse_tool_calls(text) == (text, [])


# -- what the chat side makes of tools (no model needed) ------------------------------


UNIT = {"type": "string", "enum": ["C", "F"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {  # (as pydantic writes a model with a nested one: a $ref)
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city", "unit"],
            "$defs": {"Unit": UNIT},
        },
    },
}


def test_a_forced_call_keeps_the_definitions_its_tool_refers_to():
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    from asyncllm.frontend.chat_tools import tool_choice_constraint
    from asyncllm.structured.grammar import check

    clock = {
        "type": "function",
        "function": {"name": "clock", "parameters": {"$defs": {"Unit": UNIT}}},
    }
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        constraint = tool_choice_constraint([WEATHER, clock], choice)
        check(constraint)  # (compiles: the ref resolves)
        schema = constraint.json
        good = {"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}
        jsonschema.validate(good, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "arguments": {"city": "Oslo", "unit": "K"}}, schema)
    assert "$defs" in WEATHER["function"]["parameters"]  # (the caller's tools untouched)
    other = {
        "type": "function",
        "function": {"name": "clock", "parameters": {"$defs": {"Unit": {"type": "integer"}}}},
    }
    with pytest.raises(ValueError, match="Unit"):
        tool_choice_constraint([WEATHER, other], "required")


def test_a_tool_choice_that_needs_tools_without_them_is_an_error():
    from asyncllm.frontend.chat_tools import tools_and_constraint

    assert tools_and_constraint(None, "auto") == (None, None)
    assert tools_and_constraint(None, "none") == (None, None)
    for choice in ("required", "sometimes", {"type": "function", "function": {"name": "weather"}}):
        with pytest.raises(ValueError, match="tool_choice"):
            tools_and_constraint(None, choice)


def test_an_assistant_turn_that_only_calls_tools_needs_no_content():
    from asyncllm.frontend.chat import check_conversation
    from asyncllm.frontend.chat_tools import tool_turns_for_template

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    conv = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    ]
    check_conversation(conv)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        check_conversation([{"role": "user"}])
    shown = tool_turns_for_template(conv)
    assert shown[1]["content"] is None
    assert shown[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert call["function"]["arguments"] == '{"city": "Oslo"}' and "content" not in conv[1]
    odd = {**call, "function": {"name": "weather", "arguments": "[1]"}}
    (kept,) = tool_turns_for_template([{"role": "assistant", "content": "", "tool_calls": [odd]}])
    assert kept["tool_calls"][0]["function"]["arguments"] == "[1]"


def test_a_choice_outside_the_basic_plane_can_be_generated():
    xgr = pytest.importorskip("xgrammar")
    from asyncllm.sampling_params import StructuredOutputsParams
    from asyncllm.structured.grammar import build_grammar, grammar_key

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "<eos>"], stop_token_ids=[1]))
    grammar = build_grammar(grammar_key(StructuredOutputsParams(choice=["😀 ok", "x"])))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    assert matcher.accept_string("😀 ok")
