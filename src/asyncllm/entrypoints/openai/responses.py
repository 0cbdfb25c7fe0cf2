"""RequestOutputs -> OpenAI response objects and stream chunks (plain dicts)."""

from __future__ import annotations

import weakref
from typing import Any

from asyncllm.frontend.token_bytes import byte_table
from asyncllm.outputs import CompletionOutput, PositionLogprobs, ToolCall

# tokenizer -> each token id's bytes (None: not a byte-level tokenizer), built once
_BYTES: weakref.WeakKeyDictionary[Any, list[bytes] | None] = weakref.WeakKeyDictionary()


def _token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The token's own bytes (a token that is part of a character has part of its
    UTF-8, which its decoded text cannot give); else its text's UTF-8."""
    try:
        if tokenizer not in _BYTES:
            found = byte_table(tokenizer)
            _BYTES[tokenizer] = found[0] if found is not None else None
        table = _BYTES[tokenizer]
    except TypeError:  # (None, or a tokenizer that takes no weak reference)
        table = None
    if table is not None and 0 <= token_id < len(table):
        return list(table[token_id])
    return list(text.encode("utf-8"))


def _token_text(tokenizer: Any, token_id: int, lp: Any) -> str:
    if lp is not None and lp.decoded_token is not None:
        return str(lp.decoded_token)
    return str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def _tops(tokenizer: Any, position: PositionLogprobs, n: int) -> list[tuple[str, float]]:
    return [(text, lp) for _, text, lp in _ranked(tokenizer, position, n)]


def _ranked(tokenizer: Any, position: PositionLogprobs, n: int) -> list[tuple[int, str, float]]:
    """The position's top `n`: (token id, text, logprob), most likely first."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:n]
    return [(t, _token_text(tokenizer, t, lp), lp.logprob) for t, lp in ranked]


def completion_logprobs(
    tokenizer: Any, c: CompletionOutput, top_n: int, offset: int
) -> dict[str, Any] | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset
    (offsets continue from `offset`, the text already sent for this choice)."""
    if c.logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for tid, position in zip(c.token_ids, c.logprobs):
        lp = position.get(tid)
        text = _token_text(tokenizer, tid, lp)
        tokens.append(text)
        values.append(lp.logprob if lp is not None else None)
        tops.append(dict(_tops(tokenizer, position, top_n)) if top_n else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, c: CompletionOutput, top_n: int) -> dict[str, Any] | None:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs}]."""
    if c.logprobs is None:
        return None
    content = []
    for tid, position in zip(c.token_ids, c.logprobs):
        lp = position.get(tid)
        text = _token_text(tokenizer, tid, lp)
        content.append(
            {
                "token": text,
                "logprob": lp.logprob if lp is not None else None,
                "bytes": _token_bytes(tokenizer, tid, text),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _token_bytes(tokenizer, i, t)}
                    for i, t, v in _ranked(tokenizer, position, top_n)
                ],
            }
        )
    return {"content": content}


def finish_reason(c: CompletionOutput) -> str | None:
    return (
        None if c.finish_reason is None else ("length" if c.finish_reason == "length" else "stop")
    )


def tool_finish_reason(reason: str | None, calls: list[ToolCall], tool_choice: Any) -> str | None:
    """As vLLM: 'tool_calls' when calls were parsed under tool_choice 'auto', or an
    answer forced by 'required' ended by itself; a named function's call ends 'stop'."""
    if (calls and tool_choice == "auto") or (tool_choice == "required" and reason == "stop"):
        return "tool_calls"
    return reason


def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """One call as the API gives it (in a stream's delta, with its `index`)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(
        id=call.id, type=call.type, function={"name": call.name, "arguments": call.arguments}
    )
    return out


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [tool_call(c) for c in calls]
    return message


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
