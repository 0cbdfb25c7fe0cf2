"""Conversations through the tokenizer's chat template, for both entry points."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from asyncllm.frontend.chat_tools import check_tools, tool_turns_for_template, tools_template_kwargs

Messages = list[dict[str, Any]]

_SHAPE = "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"


def as_conversations(messages: Messages | Sequence[Messages]) -> list[Messages]:
    """One conversation or a list of them -> a list of conversations (each checked)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise TypeError(_SHAPE)
    conversations: list[Any]
    if isinstance(messages[0], dict):
        conversations = [messages]
    else:
        conversations = list(messages)
    for conv in conversations:
        check_conversation(conv)
    return [list(c) for c in conversations]


ROLES = ("system", "developer", "user", "assistant", "tool")


def check_conversation(conv: Any) -> None:
    """A list of {'role': one of ROLES, 'content': str or a list of parts} dicts (an
    assistant turn may have content None when it carries tool_calls); a message that
    does not fit raises before any template sees it."""
    if not isinstance(conv, list | tuple) or not conv or not all(isinstance(m, dict) for m in conv):
        raise TypeError(_SHAPE)
    for i, m in enumerate(conv):
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {ROLES}, got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue  # (a turn that only calls tools: its content may be None or absent)
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        if not isinstance(content, str | list):
            raise TypeError(
                f"messages[{i}]['content'] must be a str or a list of parts, "
                f"got {type(content).__name__}"
            )


def render_chat(
    tokenizer: Any | None,
    messages: Messages,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
) -> dict[str, Any]:
    """The prompt (as {'prompt_token_ids': [...]}) for one conversation, with `tools`
    (checked) in the template's own way or, where it ignores them, the Hermes style.
    `add_special_tokens`: the tokenizer's own (a BOS) on top of the template's, as
    vLLM's option of that name."""
    if tokenizer is None:
        raise ValueError("chat needs the tokenizer (skip_tokenizer_init is set)")
    check_conversation(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError("chat_template_kwargs must be a dict")
    chat_template_kwargs = tools_template_kwargs(
        tokenizer, None if tools is None else check_tools(tools), messages, chat_template_kwargs
    )
    try:
        ids = tokenizer.apply_chat_template(
            tool_turns_for_template(list(messages)),
            add_generation_prompt=add_generation_prompt,
            tokenize=not add_special_tokens,  # (else the text, tokenized below)
            **(chat_template_kwargs or {}),
        )
    except TemplateError as e:  # the template refused this conversation
        raise ValueError(f"the chat template cannot render these messages: {e}") from None
    if isinstance(ids, str):
        ids = tokenizer(ids, add_special_tokens=True).input_ids
    elif not isinstance(ids, list):
        ids = ids["input_ids"]
    return {"prompt_token_ids": list(ids)}
