"""OpenAI request bodies -> SamplingParams and prompts, and OpenAI-shaped errors.

Bodies are plain JSON dicts, checked field by field: a field of the wrong type or out of
range gets a 400 naming it (`param`), before anything reaches the engine; a refusal by
the engine names the SamplingParams field it checked, and `field_error` maps that back
to the request's field that set it. Fields the engine does not serve (`best_of` > 1,
`echo`, `suffix`, `logit_bias` keyed by non-integers, a request's own chat template) are
refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncllm.frontend.chat_tools import Tools, tool_names, tools_and_constraint
from asyncllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """An error the server answers with `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(name, f"must be a number, got {type(v).__name__}")
    return float(v)


def _int(
    body: dict[str, Any], name: str, default: int | None, low: int | None = None
) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {type(v).__name__}")
    if low is not None and v < low:
        raise _bad(name, f"must be at least {low}, got {v}")
    return v


def _token_ids(body: dict[str, Any], name: str) -> list[int] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in v
    ):
        raise _bad(name, "must be a list of token ids")
    return v


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


def _stop(body: dict[str, Any]) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > 4:
            raise _bad("stop", f"at most 4 sequences, got {len(v)}")
        return list(v)
    raise _bad("stop", "must be a string or a list of strings")


@dataclass
class Options:
    """What a request asks of the server beyond sampling."""

    stream: bool
    include_usage: bool
    logprobs: int | None  # top-n per position (0: the sampled token only), None: none
    tool_choice: Any = None  # chat with tools rendered: 'auto', 'required' or a function
    tool_names: frozenset[str] = (
        frozenset()
    )  # (theirs: a plain JSON answer naming another is no call)
    parallel_tool_calls: bool = True  # (False: an answer's first call only, as vLLM)
    # SamplingParams field (and "prompt") -> the request's field that set it
    fields: dict[str, str] = field(default_factory=dict)


_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """`response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}) or vLLM's `structured_outputs` ({"json" | "regex" |
    "choice" | "grammar" | "json_object": ...}): at most one of them."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and vllm is not None:
        raise _bad("response_format", "give response_format or structured_outputs, not both")
    if vllm is not None:
        if not isinstance(vllm, dict):
            raise _bad("structured_outputs", "must be an object")
        unknown = sorted(set(vllm) - set(_STRUCTURED_FIELDS))
        if unknown:
            raise _bad("structured_outputs", f"unknown field(s): {', '.join(unknown)}")
        return StructuredOutputsParams(**vllm)
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format", "json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    raise _bad("response_format", "type must be 'text', 'json_object' or 'json_schema'")


def chat_tools(
    body: dict[str, Any], opts: Options
) -> tuple[Tools | None, StructuredOutputsParams | None]:
    """`tools`, `tool_choice` (default 'auto' with tools, 'none' without) and
    `parallel_tool_calls` (default true), set on `opts` where tools are rendered: (the
    tools the template renders, the constraint of a forced call)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools is not None else "none"
    if tools is None and choice != "none":
        raise _bad("tool_choice", "needs tools")
    parallel = _bool(body, "parallel_tool_calls", True)
    try:
        rendered, constraint = tools_and_constraint(tools, choice)
    except (ValueError, TypeError) as e:
        param = "tools" if str(e).startswith("tools") else "tool_choice"
        raise OpenAIError(str(e), param=param) from None
    if rendered is not None:
        opts.tool_choice, opts.tool_names = choice, tool_names(rendered)
        opts.parallel_tool_calls = parallel
    return rendered, constraint


def sampling_params(body: dict[str, Any], chat: bool) -> tuple[SamplingParams, Options]:
    """The request's SamplingParams (its errors become 400s naming the field)."""
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad("stream_options", "must be an object")
        if not stream:
            raise _bad("stream_options", "is only allowed with stream: true")
        include_usage = _bool(stream_options, "include_usage", False)
        if _bool(stream_options, "continuous_usage_stats", False):
            raise _bad("stream_options", "continuous_usage_stats is not supported")
    if chat:
        max_tokens = _int(body, "max_completion_tokens", None, low=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, low=1)
        logprobs = None
        if _bool(body, "logprobs", False):
            logprobs = _int(body, "top_logprobs", 0, low=0)
        elif body.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "needs logprobs: true")
    else:
        max_tokens = _int(body, "max_tokens", 16, low=1)
        logprobs = _int(body, "logprobs", None, low=0)
        if _int(body, "best_of", 1, low=1) != 1:
            raise _bad("best_of", "only 1 is supported")
        if _bool(body, "echo", False):
            raise _bad("echo", "is not supported")
        if body.get("suffix") is not None:
            raise _bad("suffix", "is not supported")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise _bad("logit_bias", "must be an object of token id -> bias")
        try:
            logit_bias = {int(k): float(v) for k, v in logit_bias.items()}
        except (TypeError, ValueError):
            raise _bad("logit_bias", "keys must be token ids and values numbers") from None
    fields = request_fields(body, chat)
    try:
        params = SamplingParams(
            n=_int(body, "n", 1, low=1) or 1,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            seed=_int(body, "seed", None),
            max_tokens=max_tokens,
            stop=_stop(body),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            logit_bias=logit_bias,
            logprobs=logprobs,
            # vLLM's extra fields
            top_k=_int(body, "top_k", 0) or 0,
            min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            min_tokens=_int(body, "min_tokens", 0, low=0) or 0,
            ignore_eos=_bool(body, "ignore_eos", False),
            stop_token_ids=_token_ids(body, "stop_token_ids"),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
    except (ValueError, TypeError) as e:
        raise field_error(e, fields) from None
    try:
        constraint = structured_outputs(body)
        if constraint is not None:
            params = params.clone(structured_outputs=constraint)
    except (ValueError, TypeError) as e:
        field = "structured_outputs" if "structured_outputs" in body else "response_format"
        raise OpenAIError(f"{field}: {e}", param=field) from None
    return params, Options(stream, include_usage, logprobs, fields=fields)


# SamplingParams fields that the request field of the same name sets
_SAME_NAME = (
    "n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "logit_bias", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
)  # fmt: skip


def request_fields(body: dict[str, Any], chat: bool) -> dict[str, str]:
    """Which request field set each SamplingParams field (and the prompt): chat's
    `top_logprobs` sets `logprobs`, `max_completion_tokens` (or `max_tokens`) sets
    `max_tokens`, and the prompt is chat's `messages`."""
    fields = {name: name for name in _SAME_NAME}
    prompt = "messages" if chat else "prompt"
    fields.update(prompt=prompt, prompt_token_ids=prompt)
    if chat:
        fields["logprobs"] = "top_logprobs"
        given = body.get("max_completion_tokens") is not None
        fields["max_tokens"] = "max_completion_tokens" if given else "max_tokens"
    else:
        fields.update(logprobs="logprobs", max_tokens="max_tokens")
    return fields


def field_error(e: Exception, fields: dict[str, str]) -> OpenAIError:
    """A refusal that names a SamplingParams field (or the prompt) first, as a 400 that
    names the request's field which set it, in `param` and in the message (`logprobs is
    50; ...` from chat's top_logprobs: `top_logprobs is 50; ...`)."""
    message = str(e)
    word = message.split(" ", 1)[0].rstrip(":")
    param = fields.get(word)
    if param is not None and param != word:
        message = param + message[len(word) :]
    return OpenAIError(message, param=param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str) -> None:
    """vLLM's refusals of a request that cannot fit the context (the offline API caps
    max_tokens instead): `field` (the request's max_tokens) past max_model_len, or the
    prompt and max_tokens together (no max_tokens: the prompt alone)."""
    out = max_tokens or 0
    if out > max_model_len:
        raise OpenAIError(
            f"{field}={out} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=field,
        )
    if prompt_len + out > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {out} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + out} tokens. Please reduce the length of "
            "the input prompt or the number of requested output tokens.",
            param="input_tokens",
            code="context_length_exceeded",
        )


@dataclass
class ChatRender:
    """How a request's messages are rendered (vLLM's fields of the same names)."""

    add_generation_prompt: bool
    add_special_tokens: bool
    template_kwargs: dict[str, Any]


def chat_render(body: dict[str, Any], server_template: str | None) -> ChatRender:
    """`add_generation_prompt` (default: true unless `continue_final_message`),
    `continue_final_message`, `add_special_tokens` (default false) and
    `chat_template_kwargs`, with the server's template (--chat-template) if it has one. A
    template of the request's own is refused, as vLLM does unless told to trust it."""
    if body.get("chat_template") is not None:
        raise _bad("chat_template", _OWN_TEMPLATE)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    kwargs = dict(kwargs or {})
    if "chat_template" in kwargs:
        raise _bad("chat_template_kwargs", _OWN_TEMPLATE)
    if server_template is not None:
        kwargs["chat_template"] = server_template
    go_on = _bool(body, "continue_final_message", False)
    add_generation_prompt = _bool(body, "add_generation_prompt", not go_on)
    if go_on:
        if add_generation_prompt:
            raise _bad("continue_final_message", "cannot be true with add_generation_prompt true")
        kwargs["continue_final_message"] = True
    return ChatRender(add_generation_prompt, _bool(body, "add_special_tokens", False), kwargs)


_OWN_TEMPLATE = "a request's own chat template is not accepted (the server's is used)"


@dataclass
class TokenizeRequest:
    """POST /tokenize (vLLM's): a text `prompt` (`add_special_tokens`, default true), or
    chat `messages` rendered as chat completions renders them (`render`)."""

    prompt: str | None
    add_special_tokens: bool
    messages: list[dict[str, Any]] | None
    render: ChatRender | None
    return_token_strs: bool


def tokenize_request(body: dict[str, Any], server_template: str | None) -> TokenizeRequest:
    strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        render = chat_render(body, server_template)
        return TokenizeRequest(None, False, chat_messages(body), render, strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("prompt", "must be a string (or give messages)")
    return TokenizeRequest(prompt, _bool(body, "add_special_tokens", True), None, None, strs)


def detokenize_tokens(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise _bad("tokens", "must be a list of token ids")
    return tokens


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return list(prompt)
    raise _bad("prompt", "must be a string, a list of token ids, or a non-empty list of either")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`messages`, with list-of-parts content joined to text, a part a line (only text
    parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content[{j}].text", "must be a string")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out
