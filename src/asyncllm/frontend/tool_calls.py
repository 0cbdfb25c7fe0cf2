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
