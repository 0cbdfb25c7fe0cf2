"""The API's description: an OpenAPI 3.1 document of the routes and the request bodies
they read (`GET /openapi.json`), and Swagger UI over it (`GET /docs`), the two pages
FastAPI serves, without FastAPI.

The request schemas list the fields protocol.py reads; tests/entrypoints checks that
every route of the app is described here.
"""

from __future__ import annotations

import html
import json
from typing import Any

from asyncllm.frontend.chat import ROLES

STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
NUM: dict[str, Any] = {"type": "number"}
BOOL: dict[str, Any] = {"type": "boolean"}
OBJ: dict[str, Any] = {"type": "object"}
TOKEN_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _obj(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _at_least(n: int, schema: dict[str, Any] = INT) -> dict[str, Any]:
    return {**schema, "minimum": n}


# Both generation routes: OpenAI's sampling fields, then vLLM's.
SAMPLING = {
    "model": STR,
    "n": _at_least(1),
    "temperature": _at_least(0, NUM),
    "top_p": NUM,
    "seed": INT,
    "stop": {"anyOf": [STR, {"type": "array", "items": STR, "maxItems": 4}]},
    "presence_penalty": NUM,
    "frequency_penalty": NUM,
    "logit_bias": {"type": "object", "additionalProperties": NUM},
    "stream": BOOL,
    "stream_options": _obj({"include_usage": BOOL}),
    "response_format": _obj(
        {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": OBJ}, "type"
    ),
    "structured_outputs": _obj(
        {
            "json": {"anyOf": [OBJ, STR]},
            "regex": STR,
            "choice": {"type": "array", "items": STR},
            "grammar": STR,
            "json_object": BOOL,
            "disable_any_whitespace": BOOL,
        }
    ),
    "top_k": INT,
    "min_p": NUM,
    "repetition_penalty": NUM,
    "min_tokens": _at_least(0),
    "ignore_eos": BOOL,
    "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
}

# How messages are rendered: chat completions and /tokenize.
CHAT_RENDER = {
    "add_generation_prompt": BOOL,
    "continue_final_message": BOOL,
    "add_special_tokens": BOOL,
    "chat_template_kwargs": OBJ,
    "tools": {"type": "array", "items": _obj({"type": STR, "function": OBJ}, "function")},
}

MESSAGE = _obj(
    {
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [
                STR,
                {"type": "array", "items": _obj({"type": {"const": "text"}, "text": STR})},
                {"type": "null"},
            ]
        },
        "tool_calls": {"type": "array", "items": OBJ},
        "tool_call_id": STR,
        "name": STR,
    },
    "role",
)
MESSAGES = {"type": "array", "items": _ref("ChatMessage"), "minItems": 1}

SCHEMAS: dict[str, Any] = {
    "ChatMessage": MESSAGE,
    "CompletionRequest": _obj(
        {
            **SAMPLING,
            "prompt": {
                "anyOf": [
                    STR,
                    TOKEN_IDS,
                    {"type": "array", "items": STR},
                    {"type": "array", "items": TOKEN_IDS},
                ]
            },
            "max_tokens": _at_least(1),
            "logprobs": _at_least(0),
            "best_of": {"const": 1},
            "echo": {"const": False},
        },
        "prompt",
    ),
    "ChatCompletionRequest": _obj(
        {
            **SAMPLING,
            **CHAT_RENDER,
            "messages": MESSAGES,
            "max_tokens": _at_least(1),
            "max_completion_tokens": _at_least(1),
            "logprobs": BOOL,
            "top_logprobs": _at_least(0),
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, OBJ]},
            "parallel_tool_calls": BOOL,
        },
        "messages",
    ),
    "TokenizeRequest": {
        "anyOf": [
            _obj(
                {
                    "model": STR,
                    "prompt": STR,
                    "add_special_tokens": BOOL,
                    "return_token_strs": BOOL,
                },
                "prompt",
            ),
            _obj(
                {"model": STR, "messages": MESSAGES, **CHAT_RENDER, "return_token_strs": BOOL},
                "messages",
            ),
        ]
    },
    "TokenizeResponse": _obj(
        {
            "count": INT,
            "max_model_len": INT,
            "tokens": TOKEN_IDS,
            "token_strs": {"anyOf": [{"type": "array", "items": STR}, {"type": "null"}]},
        },
        "count",
        "max_model_len",
        "tokens",
    ),
    "DetokenizeRequest": _obj({"model": STR, "tokens": TOKEN_IDS}, "tokens"),
    "DetokenizeResponse": _obj({"prompt": STR}, "prompt"),
    "Model": _obj(
        {
            "id": STR,
            "object": {"const": "model"},
            "created": INT,
            "owned_by": STR,
            "max_model_len": INT,
        },
        "id",
        "object",
    ),
    "ModelList": _obj(
        {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}
    ),
    "Version": _obj({"version": STR}, "version"),
    "Error": _obj(
        {
            "error": _obj(
                {
                    "message": STR,
                    "type": STR,
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
                "message",
                "type",
            )
        },
        "error",
    ),
}


def _answer(what: str, schema: dict[str, Any] | None, media: str = "application/json") -> Any:
    answer: dict[str, Any] = {"description": what}
    if schema is not None:
        answer["content"] = {media: {"schema": schema}}
    return answer


ERRORS = {
    "400": _answer("a request the server cannot serve, the field named in `param`", _ref("Error")),
    "503": _answer("the engine is not running, or too busy (Retry-After)", _ref("Error")),
}


def _op(summary: str, answer: dict[str, Any], body: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": answer, **ERRORS}}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


GENERATED = "the answer; with stream: true, server-sent events ending `data: [DONE]`"

PATHS: dict[str, Any] = {
    "/v1/chat/completions": {
        "post": _op("Chat completion", _answer(GENERATED, OBJ), "ChatCompletionRequest")
    },
    "/v1/completions": {"post": _op("Completion", _answer(GENERATED, OBJ), "CompletionRequest")},
    "/v1/models": {"get": _op("The model served", _answer("the list", _ref("ModelList")))},
    "/v1/models/{model_id}": {
        "get": {
            **_op("One model", _answer("the model", _ref("Model"))),
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": STR}],
        }
    },
    "/tokenize": {
        "post": _op(
            "Token ids of a prompt or of messages",
            _answer("the ids", _ref("TokenizeResponse")),
            "TokenizeRequest",
        )
    },
    "/detokenize": {
        "post": _op(
            "Text of token ids",
            _answer("the text", _ref("DetokenizeResponse")),
            "DetokenizeRequest",
        )
    },
    "/version": {"get": _op("The server's version", _answer("the version", _ref("Version")))},
    "/health": {"get": _op("200 while the engine runs", _answer("running", None))},
    "/metrics": {"get": _op("Prometheus metrics", _answer("the text format", STR, "text/plain"))},
}


def openapi_document(version: str, root_path: str) -> dict[str, Any]:
    """The whole document; behind a proxy's `root_path` its server URL carries it."""
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "asyncllm", "version": version},
        "paths": PATHS,
        "components": {"schemas": SCHEMAS},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document


SWAGGER_UI = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5"


def docs_page(openapi_url: str, title: str) -> str:
    """Swagger UI (from its CDN, as FastAPI's page) over the document at `openapi_url`."""
    url = json.dumps(openapi_url).replace("<", "\\u003c")  # (no "</script>" inside)
    return f"""<!doctype html>
<html>
<head>
<meta charset="utf-8">
<title>{html.escape(title)} - Swagger UI</title>
<link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{SWAGGER_UI}/swagger-ui-bundle.js"></script>
<script>
SwaggerUIBundle({{url: {url}, dom_id: "#swagger-ui"}});
</script>
</body>
</html>
"""
