"""Tool calls in a model's text: the Hermes/Qwen style (`<tool_call>{...}</tool_call>`,
one block per call) and plain JSON (a call object, or a list of them, as the whole
answer). Each call is `{"name": ..., "arguments": {...}}` (`parameters` is taken for
`arguments`; arguments given as a JSON string holding an object are kept as they are).

Plain JSON is only a call when it has that shape and nothing else (a name, and its
arguments), and, where the request's tool names are given, names one of them: else it
is a JSON answer (`{"name": "Alice", "age": 30}` is not a call). A block's marker says
that it is a call, so its arguments may be left out (`{}`).

`parse_tool_calls` never raises on what a model writes: text that holds no well-formed
call comes back as plain content with no calls, and a malformed `<tool_call>` block
stays in the content. Well-formed means strict JSON: NaN and Infinity are not JSON, and
nesting too deep to decode is malformed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

from asyncllm.outputs import ToolCall

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL_KEYS = frozenset({"name", "arguments", "parameters"})
_BAD = object()  # (what `_decode` gives for text that is not one strict JSON value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _decode(text: str) -> Any:
    """The JSON value `text` holds (blanks around it allowed), or _BAD."""
    try:
        value, end = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
    except (ValueError, RecursionError):
        return _BAD
    return value if not text[end:].strip() else _BAD


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any, names: Collection[str] | None, plain: bool) -> ToolCall | None:
    """A call from a decoded JSON value, or None if it is not one (`plain`: a whole
    answer in plain JSON, held to the stricter shape)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if plain and (
        not obj.keys() <= _CALL_KEYS
        or ("arguments" not in obj and "parameters" not in obj)
        or (names is not None and name not in names)
    ):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        if not isinstance(_decode(args), dict):
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(_call_id(), name, text)


def _calls_of(value: Any, names: Collection[str] | None, plain: bool) -> list[ToolCall] | None:
    """Calls from a call object or a non-empty list of call objects; None otherwise."""
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v, names, plain) for v in items]
    if not items or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _block_at(text: str, start: int) -> tuple[int, Any]:
    """The block whose marker starts at `start`: (its end, its JSON value), the value
    _BAD if it is malformed. A block is one JSON value after the marker, then the
    closing tag, the next block's marker or the end of the text."""
    at = start + len(_OPEN)
    at += len(text[at:]) - len(text[at:].lstrip())
    try:
        value, end = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return at, _BAD
    end += len(text[end:]) - len(text[end:].lstrip())
    if text.startswith(_CLOSE, end):
        return end + len(_CLOSE), value
    if end == len(text) or text.startswith(_OPEN, end):
        return end, value
    return at, _BAD


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(the content left once the calls are taken out, the calls). With no call in the
    text: (text, []). `names`: the request's tool names (a plain JSON answer naming
    another is not a call)."""
    if _OPEN in text:
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = pos = 0
        while (start := text.find(_OPEN, pos)) >= 0:
            end, value = _block_at(text, start)
            found = None if value is _BAD else _calls_of(value, names, plain=False)
            pos = end if found is not None else start + len(_OPEN)
            if found is None:
                continue  # (malformed: the block stays in the content)
            kept.append(text[last:start])
            last = end
            calls += found
        kept.append(text[last:])
        return ("".join(kept).strip() if calls else text), calls
    stripped = text.strip()
    if stripped and stripped[0] in "{[":
        value = _decode(stripped)
        found = None if value is _BAD else _calls_of(value, names, plain=True)
        if found:
            return "", found
    return text, []


class ToolCallStream:
    """Splits a streamed answer into content that can be sent as it comes and the calls
    at its end: text that may begin a call (a `<tool_call>` block, or an answer that
    opens with `{` or `[`, plain JSON) is held back until the answer ends, then parsed;
    what turns out not to be a call is sent as content then."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = names  # (the request's tool names: see parse_tool_calls)
        self.text = ""
        self._sent = 0  # how much of text went out as content
        self._holding = False  # from _sent on, everything waits for the end

    def feed(self, delta: str) -> str:
        """The content of `delta` that can go out now."""
        self.text += delta
        if self._holding:
            return ""
        if not self.text.strip():
            return ""  # (leading blanks wait: a JSON call may follow)
        if self._sent == 0 and self.text.lstrip()[0] in "{[":
            self._holding = True
            return ""
        mark = self.text.find(_OPEN, self._sent)
        if mark >= 0:
            self._holding = True
            end = mark
        else:  # a tail that may be the start of the marker waits
            end = len(self.text)
            for k in range(min(len(_OPEN) - 1, len(self.text)), 0, -1):
                if self.text.endswith(_OPEN[:k]):
                    end -= k
                    break
        out, self._sent = self.text[self._sent : end], max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the calls) once the answer has ended."""
        rest = self.text[self._sent :]
        self._sent = len(self.text)
        return parse_tool_calls(rest, self.names)
