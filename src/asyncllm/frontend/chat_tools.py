"""Tools in chat: checking `tools` and `tool_choice`, the Hermes-style fallback template
for models whose own template ignores tools (or breaks on an assistant turn that only
calls tools), the constraint that forces a call, and the parsed calls on the outputs."""

from __future__ import annotations

import json
from typing import Any

from asyncllm.frontend.tool_calls import parse_tool_calls
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams

Tools = list[dict[str, Any]]

# ChatML with the tools in the system turn and calls as <tool_call> blocks (the format
# Hermes and Qwen models are trained on); tool results come back as <tool_response>.
# Every newline is printed by an expression: transformers compiles templates with
# trim_blocks, which drops a newline that follows a block tag.
HERMES_TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}"
    "{% else %}{% set sys = 'You are a helpful assistant.' %}{% set rest = messages %}"
    "{% endif %}"
    "<|im_start|>system{{ nl }}{{ sys }}"
    "{% if tools %}{{ nl ~ nl }}You may call functions to answer. The functions are "
    "inside <tools></tools>:{{ nl }}<tools>"
    "{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}"
    "{{ nl }}</tools>{{ nl }}To call one, answer with a JSON object of the function's "
    "name and arguments inside <tool_call></tool_call>:{{ nl }}<tool_call>{{ nl }}"
    '{"name": <function-name>, "arguments": <arguments-object>}{{ nl }}</tool_call>'
    "{% endif %}<|im_end|>{{ nl }}"
    "{% for m in rest %}"
    "{% if m['role'] == 'tool' %}"
    "<|im_start|>user{{ nl }}<tool_response>{{ nl }}{{ m['content'] }}{{ nl }}"
    "</tool_response><|im_end|>{{ nl }}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|im_start|>assistant{{ nl }}{% if m['content'] %}{{ m['content'] }}{{ nl }}{% endif %}"
    "{% for c in m['tool_calls'] %}{% set f = c['function'] if c.get('function') else c %}"
    "{% if not loop.first %}{{ nl }}{% endif %}"
    '<tool_call>{{ nl }}{"name": {{ f["name"] | tojson }}, "arguments": '
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}"
    "{{ nl }}</tool_call>{% endfor %}<|im_end|>{{ nl }}"
    "{% else %}<|im_start|>{{ m['role'] }}{{ nl }}{{ m['content'] }}<|im_end|>{{ nl }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)


def check_tools(tools: Any) -> Tools:
    """`tools` as OpenAI gives them: [{'type': 'function', 'function': {'name', ...}}]."""
    if not isinstance(tools, list | tuple) or not tools:
        raise TypeError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise TypeError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}]['function']['name'] must be a non-empty str")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise TypeError(f"tools[{i}]['function']['parameters'] must be a JSON schema dict")
    return list(tools)


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_DEFS = ("$defs", "definitions")  # (where a schema keeps what its "#/..." refs name)


def _forced_call_schema(fns: list[dict[str, Any]]) -> dict[str, Any]:
    """One call to any of `fns`, as plain JSON. Each tool's parameters sit under the
    call's `arguments`, so the definitions they refer to from their root (`$defs`,
    `definitions`: `#/$defs/...`) move up to the root of this schema, shared; ValueError
    if two tools define one name differently."""
    shared: dict[str, dict[str, Any]] = {}
    schemas = []
    for fn in fns:
        params = fn.get("parameters") or {}
        if any(key in params for key in _DEFS):
            params = dict(params)
            for key in _DEFS:
                for name, definition in (params.pop(key, None) or {}).items():
                    known = shared.setdefault(key, {}).setdefault(name, definition)
                    if known != definition:
                        raise ValueError(
                            f"tools: {fn['name']!r} and another tool define "
                            f"{key}/{name} differently; a forced call needs them alike"
                        )
            fn = {**fn, "parameters": params}
        schemas.append(_call_schema(fn))
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**schema, **shared}


def tool_choice_constraint(tools: Tools, tool_choice: Any) -> StructuredOutputsParams | None:
    """The constraint that `tool_choice` puts on the answer: none for 'auto' and 'none';
    for 'required', one call (plain JSON) to any of the tools; for a named function
    ({'type': 'function', 'function': {'name': ...}}), one call to it."""
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools]
    if tool_choice == "required":
        chosen = fns
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [f for f in fns if f["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    else:
        raise ValueError(
            "tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
        )
    return StructuredOutputsParams(json=_forced_call_schema(chosen))


def tools_and_constraint(
    tools: Any, tool_choice: Any
) -> tuple[Tools | None, StructuredOutputsParams | None]:
    """(the tools the chat template renders: None without tools or with tool_choice
    'none'; the constraint a forced call puts on the answer), `tools` checked."""
    if tools is None:
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice={tool_choice!r} needs tools")
        return None, None
    tools = check_tools(tools)
    constraint = tool_choice_constraint(tools, tool_choice)
    return (None if tool_choice == "none" else tools), constraint


def with_tool_choice(
    params: SamplingParams | None, constraint: StructuredOutputsParams | None
) -> SamplingParams | None:
    """The sampling parameters with the forced call's constraint (ValueError if they
    carry structured_outputs of their own)."""
    if constraint is None:
        return params
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError("sampling_params must be a SamplingParams")
    if params.structured_outputs is not None:
        raise ValueError(
            "tool_choice forces a call: sampling_params.structured_outputs must be unset"
        )
    return params.clone(structured_outputs=constraint)


# chat template text -> whether it renders tools (one probe per distinct template)
_USES_TOOLS: dict[str | None, bool] = {}


def template_uses_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's own chat template renders `tools` and an assistant turn
    that only calls tools (content None): else the Hermes fallback is used."""
    template = getattr(tokenizer, "chat_template", None)
    if template not in _USES_TOOLS:
        probe_tool = {"type": "function", "function": {"name": "probe_fn_x7", "parameters": {}}}
        call = {"type": "function", "function": {"name": "probe_fn_x7", "arguments": {}}}
        conv = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok"},
        ]
        try:
            text = tokenizer.apply_chat_template(conv, tools=[probe_tool], tokenize=False)
            uses = isinstance(text, str) and text.count("probe_fn_x7") >= 2
        except Exception:  # noqa: BLE001 (a template that breaks on tools: the fallback)
            uses = False
        _USES_TOOLS[template] = uses
    return _USES_TOOLS[template]


def tool_turns_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates expect its assistant turns that call tools:
    `content` None where it is left out, and each call's `arguments` given as a JSON
    string (OpenAI's form) decoded to its object (templates render it with `tojson`: a
    string would come out quoted, escapes and all). The caller's messages are not
    changed; arguments that are not a JSON object stay as they are."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, list) and calls:
            m = {**m, "content": m.get("content"), "tool_calls": [_decoded_call(c) for c in calls]}
        out.append(m)
    return out


def _string_arguments(call: Any) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("arguments"), str)


def _decoded_call(call: Any) -> Any:
    if not _string_arguments(call):
        return call
    try:
        args = json.loads(call["function"]["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": args}}


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether the conversation holds a tool result or an assistant turn with calls."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def tools_template_kwargs(
    tokenizer: Any,
    tools: Tools | None,
    messages: list[dict[str, Any]],
    chat_template_kwargs: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The template arguments that render `tools` and the conversation's tool turns:
    the tokenizer's template if it handles them, else the Hermes fallback."""
    if tools is None and not has_tool_turns(messages):
        return chat_template_kwargs
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    if "chat_template" not in kwargs and not template_uses_tools(tokenizer):
        kwargs["chat_template"] = HERMES_TEMPLATE
    return kwargs


def tool_names(tools: Tools) -> frozenset[str]:
    """The names of `tools` (checked ones): a plain JSON answer is a call only to one."""
    return frozenset(t["function"]["name"] for t in tools)


def attach_tool_calls(out: RequestOutput, tools: Tools) -> RequestOutput:
    """Parses each completion's text for calls to `tools`: where there are some,
    `tool_calls` holds them and `text` what is left."""
    names = tool_names(tools)
    for c in out.outputs:
        content, calls = parse_tool_calls(c.text, names)
        if calls:
            c.text, c.tool_calls = content, calls
    return out
