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
