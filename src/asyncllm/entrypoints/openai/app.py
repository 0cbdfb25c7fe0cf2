"""The OpenAI-compatible HTTP API over one AsyncLLM, as an ASGI app (Starlette).

`build_app(llm)` serves `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health` and `/metrics` from an AsyncLLM that the caller owns (starts and shuts down),
so an application can mount it next to its own routes and share the engine.
`asyncllm serve` (server.py) runs it on uvicorn with the engine's life cycle.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncllm.entrypoints.async_llm import AsyncLLM
from asyncllm.entrypoints.openai import responses as R
from asyncllm.entrypoints.openai.metrics import render_metrics
from asyncllm.entrypoints.openai.protocol import (
    OpenAIError,
    Options,
    chat_messages,
    chat_tools,
    completion_prompts,
    sampling_params,
)
from asyncllm.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from asyncllm.frontend.chat_tools import with_tool_choice
from asyncllm.frontend.tool_calls import ToolCallStream, parse_tool_calls
from asyncllm.outputs import RequestOutput, ToolCall
from asyncllm.sampling_params import SamplingParams

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 << 20  # (a 128k-token prompt as ids is ~1 MB of JSON)


class ClientGone(Exception):
    """The client disconnected before its answer: its requests were aborted."""


class OpenAIServer:
    def __init__(
        self, llm: AsyncLLM, model_name: str, api_key: str | None, max_body_bytes: int
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.finished: Counter[str] = Counter()

    # -- plumbing ----------------------------------------------------------------------

    def route(self, fn: Handler, v1: bool = True) -> Handler:
        """Every route: 503 once the engine is dead, the API key on /v1, errors as
        OpenAI error bodies, and the count of answers by route and status."""

        async def handle(request: Request) -> Response:
            try:
                if self.llm.errored or not self.llm.is_running:
                    raise OpenAIError(
                        f"the engine is not running: {self.llm.dead_error or 'shut down'}",
                        503,
                        "service_unavailable",
                    )
                if v1 and self.api_key is not None:
                    self._check_key(request)
                response = await fn(request)
            except OpenAIError as e:
                response = JSONResponse(e.body(), e.status, headers=e.headers)
            except RecursionError:  # (a body or message nested past what can be read)
                response = _error_response(OpenAIError("the request is nested too deeply"))
            except ClientGone:
                response = Response(status_code=499)  # (nobody reads it: counted only)
            except Exception as e:  # noqa: BLE001 (a bug: a 500 in the API's shape)
                logger.exception("%s failed", request.url.path)
                response = _error_response(
                    OpenAIError(f"internal error: {type(e).__name__}", 500, "internal_error")
                )
            self.http_requests[(request.url.path, response.status_code)] += 1
            return response

        return handle

    def _check_key(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        assert self.api_key is not None
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise OpenAIError(
                "invalid or missing API key", 401, "invalid_request_error", code="invalid_api_key"
            )

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await self._read_body(request)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"the model {model!r} does not exist (this server has {self.model_name!r})",
                404,
                param="model",
                code="model_not_found",
            )
        return body

    async def _read_body(self, request: Request) -> bytes:
        """The body, up to `max_body_bytes` (413 past it, before more is read)."""
        limit = self.max_body_bytes
        too_big = OpenAIError(
            f"the request body is larger than {limit} bytes", 413, code="request_too_large"
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:  # (gone before its body was in: nothing was started)
            raise ClientGone from None
        return b"".join(chunks)

    async def _unless_gone(self, request: Request, work: Awaitable[T], streams: list[Any]) -> T:
        """`work`'s result, unless the client disconnects first: then `work` is
        cancelled, every stream closed (its request aborted), and ClientGone raised."""
        result: list[T] = []
        error: list[Exception] = []
        gone = False
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                nonlocal gone
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                gone = True
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:  # (raised in here, it would come out wrapped in an ExceptionGroup)
                result.append(await work)
            except Exception as e:  # noqa: BLE001 (raised below, as it is)
                error.append(e)
            group.cancel_scope.cancel()
        if error:
            raise error[0]
        if gone or not result:
            await _close(streams)
            raise ClientGone
        return result[0]

    # -- routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        max_len = self.llm.config.max_model_len if self.llm.config else None
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "asyncllm",
            "max_model_len": max_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(self, request: Request) -> Response:
        stats = await self.llm.get_stats()
        text = render_metrics(stats, self.http_requests, self.finished)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        params, opts = sampling_params(body, chat=False)
        prompts = completion_prompts(body)
        return await self._serve(request, prompts, params, opts, chat=False, prefix="cmpl")

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        params, opts = sampling_params(body, chat=True)
        tools, constraint = chat_tools(body, opts)  # (no tools rendered: only content)
        try:
            params = with_tool_choice(params, constraint) or params
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice") from None
        messages = chat_messages(body)
        kwargs = body.get("chat_template_kwargs")
        try:
            prompt = await self.llm.render_chat(messages, chat_template_kwargs=kwargs, tools=tools)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param="messages") from None
        return await self._serve(request, [prompt], params, opts, chat=True, prefix="chatcmpl")

    # -- generation --------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        prompts: list[Any],
        params: SamplingParams,
        opts: Options,
        chat: bool,
        prefix: str,
    ) -> Response:
        """Generates for `prompts`; a client that leaves before the answer (or, streamed,
        before its first chunk) aborts its requests (the stream's own end does so later)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        streams = [self.llm.generate(p, params) for p in prompts]
        # (errors here are still 400/503s)
        firsts = await self._unless_gone(request, _first_outputs(streams), streams)
        if opts.stream:
            chunks = self._chunks(rid, streams, firsts, params.n, opts, chat)
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        finals = await self._unless_gone(request, _finals(firsts, streams), streams)
        return JSONResponse(self._response(rid, finals, params.n, opts, chat))

    def _response(
        self, rid: str, finals: list[RequestOutput], n: int, opts: Options, chat: bool
    ) -> dict[str, Any]:
        tok = self.llm.tokenizer
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                reason = R.finish_reason(c)
                calls: list[ToolCall] = []
                content = c.text
                if chat and opts.tool_choice is not None:
                    content, calls = parse_tool_calls(c.text, opts.tool_names)
                    calls = calls if opts.parallel_tool_calls else calls[:1]
                    reason = R.tool_finish_reason(reason, calls, opts.tool_choice)
                self.finished[reason or "abort"] += 1
                choice: dict[str, Any] = {"index": i * n + c.index, "finish_reason": reason}
                if chat:
                    choice["message"] = R.assistant_message(content, calls)
                    choice["logprobs"] = (
                        R.chat_logprobs(tok, c, opts.logprobs or 0)
                        if opts.logprobs is not None
                        else None
                    )
                else:
                    choice["text"] = c.text
                    choice["logprobs"] = (
                        R.completion_logprobs(tok, c, opts.logprobs or 0, 0)
                        if opts.logprobs is not None
                        else None
                    )
                choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": R.usage(prompt_tokens, completion_tokens),
        }

    async def _chunks(
        self,
        rid: str,
        streams: list[AsyncGenerator[RequestOutput, None]],
        firsts: list[RequestOutput],
        n: int,
        opts: Options,
        chat: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        tok = self.llm.tokenizer
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent_role: set[int] = set()
        splitters: dict[int, ToolCallStream] = {}  # with tools: each choice's answer
        offsets: Counter[int] = Counter()
        tokens: Counter[int] = Counter()
        prompt_tokens = sum(len(f.prompt_token_ids) for f in firsts)
        async for i, out in _merge(streams, firsts):
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                tokens[index] += len(c.token_ids)
                reason = R.finish_reason(c)
                content = c.text
                calls: list[ToolCall] = []
                if chat and opts.tool_choice is not None:
                    splitter = splitters.setdefault(index, ToolCallStream(opts.tool_names))
                    content = splitter.feed(c.text)
                    if reason is not None:
                        rest, calls = splitter.finish()
                        calls = calls if opts.parallel_tool_calls else calls[:1]
                        content += rest
                        reason = R.tool_finish_reason(reason, calls, opts.tool_choice)
                if reason is not None:
                    self.finished[reason] += 1
                choice: dict[str, Any] = {"index": index, "finish_reason": reason}
                if chat:
                    delta: dict[str, Any] = {"content": content or (None if calls else "")}
                    if calls:
                        delta["tool_calls"] = [R.tool_call(call, k) for k, call in enumerate(calls)]
                    if index not in sent_role:
                        sent_role.add(index)
                        delta = {"role": "assistant", **delta}
                    choice["delta"] = delta
                    if opts.logprobs is not None:
                        choice["logprobs"] = R.chat_logprobs(tok, c, opts.logprobs)
                else:
                    choice["text"] = c.text
                    if opts.logprobs is not None:
                        choice["logprobs"] = R.completion_logprobs(
                            tok, c, opts.logprobs, offsets[index]
                        )
                    offsets[index] += len(c.text)
                choices.append(choice)
            if choices:
                yield {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": self.model_name,
                    "choices": choices,
                }
        if opts.include_usage:
            yield {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": R.usage(prompt_tokens, sum(tokens.values())),
            }


# -- streams -------------------------------------------------------------------------


def _engine_error(e: Exception) -> OpenAIError:
    if isinstance(e, ValueError | TypeError):
        return OpenAIError(str(e))
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(str(e), 503, "service_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), 503, "service_unavailable")
    if isinstance(e, RequestFailedError):
        return OpenAIError(str(e), 500, "internal_error")
    raise e


async def _first_outputs(streams: list[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """Each stream's first output, together; at the first error the others are
    cancelled, every stream is closed (its request aborted), and the error becomes an
    OpenAIError."""
    results: list[Any] = [None] * len(streams)
    failures: list[Exception] = []

    async def first(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            results[i] = await anext(stream)
        except Exception as e:  # noqa: BLE001 (the caller raises it)
            failures.append(e)
            group.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            for i, stream in enumerate(streams):
                group.start_soon(first, i, stream)
    except BaseException:  # cancelled: nothing may keep running
        await _close(streams)
        raise
    if failures:
        await _close(streams)
        raise _engine_error(failures[0]) from None
    return results


async def _close(streams: list[AsyncGenerator[RequestOutput, None]]) -> None:
    """Closes every stream (aborting its request); one that fails to close does not
    keep the others open."""
    for s in streams:
        try:
            await s.aclose()
        except Exception:  # noqa: BLE001 (logged: the others still close)
            logger.exception("a stream did not close cleanly")


async def _finals(
    firsts: list[RequestOutput], streams: list[AsyncGenerator[RequestOutput, None]]
) -> list[RequestOutput]:
    return [f if f.finished else await _last(s) for f, s in zip(firsts, streams)]


async def _last(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    last = None
    try:
        async for out in stream:
            last = out
    except Exception as e:
        raise _engine_error(e) from None
    assert last is not None
    return last


async def _merge(
    streams: list[AsyncGenerator[RequestOutput, None]], firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come, starting with the firsts.
    Leaving early (a client gone) closes every stream, which aborts its request."""
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = {i: s for i, s in enumerate(streams) if not firsts[i].finished}
        if len(live) == 1:
            ((i, s),) = live.items()
            async for out in s:
                yield i, out
            return
        pending = {asyncio.ensure_future(anext(s)): i for i, s in live.items()}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    out = fut.result()
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(live[i]))] = i
        finally:  # (the reads in flight end before their streams are closed)
            for fut in pending:
                fut.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await _close(streams)


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    except Exception as e:  # after the headers: the error goes in the stream
        err = e if isinstance(e, OpenAIError) else _safe_error(e)
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(OpenAIError(f"no route {request.url.path}", 404, "not_found_error"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    error = OpenAIError(f"{request.method} is not allowed on {request.url.path}", 405)
    return _error_response(error)


def _safe_error(e: Exception) -> OpenAIError:
    try:
        return _engine_error(e)
    except Exception:
        return OpenAIError(f"internal error: {e}", 500, "internal_error")


def build_app(
    llm: AsyncLLM,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    """The OpenAI-compatible API over a started AsyncLLM (the caller owns its life
    cycle). `model_name` is what /v1/models lists and requests must name (default: the
    engine's model, or "default" for the embedded one); with `api_key`, /v1 routes need
    `Authorization: Bearer <key>`; a request body past `max_body_bytes` is a 413."""
    if not isinstance(llm, AsyncLLM):
        raise TypeError(f"llm must be an AsyncLLM, got {type(llm).__name__}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise TypeError("max_body_bytes must be an int")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    name = model_name or llm.args.model or "default"
    server = OpenAIServer(llm, name, api_key, max_body_bytes)
    routes = [
        Route("/health", server.route(server.health, v1=False), methods=["GET"]),
        Route("/metrics", server.route(server.metrics, v1=False), methods=["GET"]),
        Route("/v1/models", server.route(server.models), methods=["GET"]),
        Route("/v1/completions", server.route(server.completions), methods=["POST"]),
        Route("/v1/chat/completions", server.route(server.chat_completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.openai_server = server
    return app
