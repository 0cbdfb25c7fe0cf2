"""Tool calls in a model's text: the Hermes/Qwen style (`<tool_call>{...}</tool_call>`,
one block per call) and plain JSON (a call object, or a list of them, as the whole
answer). Each call is `{"name": ..., "arguments": {...}}` (`parameters` is taken for
`arguments`; arguments given as a JSON string are kept as they are).

`parse_tool_calls` never raises on what a model writes: text that holds no well-formed
call comes back as plain content with no calls, and a malformed `<tool_call>` block
stays in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from asyncllm.outputs import ToolCall

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(obj: Any) -> ToolCall | None:
    """A call from a decoded JSON value, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(_call_id(), name, text)


def _calls_of(value: Any) -> list[ToolCall] | None:
    """Calls from a call object or a non-empty list of call objects; None otherwise."""
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v) for v in items]
    if not items or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the content left once the calls are taken out, the calls). With no call in the
    text: (text, [])."""
    if "<tool_call>" in text:
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for m in _BLOCK.finditer(text):
            try:
                found = _calls_of(json.loads(m.group(1)))
            except ValueError:
                found = None
            if found is None:
                continue  # (malformed: the block stays in the content)
            kept.append(text[last : m.start()])
            last = m.end()
            calls += found
        kept.append(text[last:])
        return ("".join(kept).strip() if calls else text), calls
    stripped = text.strip()
    if stripped and stripped[0] in "{[":
        try:
            found = _calls_of(json.loads(stripped))
        except ValueError:
            found = None
        if found:
            return "", found
    return text, []


_MARK = "<tool_call>"


class ToolCallStream:
    """Splits a streamed answer into content that can be sent as it comes and the calls
    at its end: text that may begin a call (a `<tool_call>` block, or an answer that
    opens with `{` or `[`, plain JSON) is held back until the answer ends, then parsed;
    what turns out not to be a call is sent as content then."""

    def __init__(self) -> None:
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
        mark = self.text.find(_MARK, self._sent)
        if mark >= 0:
            self._holding = True
            end = mark
        else:  # a tail that may be the start of the marker waits
            end = len(self.text)
            for k in range(min(len(_MARK) - 1, len(self.text)), 0, -1):
                if self.text.endswith(_MARK[:k]):
                    end -= k
                    break
        out, self._sent = self.text[self._sent : end], max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet sent, the calls) once the answer has ended."""
        rest = self.text[self._sent :]
        self._sent = len(self.text)
        return parse_tool_calls(rest)
