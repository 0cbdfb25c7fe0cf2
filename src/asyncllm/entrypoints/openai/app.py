"""The OpenAI-compatible HTTP API over one AsyncLLM, as an ASGI app (Starlette).

`build_app(llm)` serves `/v1/chat/completions`, `/v1/completions`, `/v1/models` (and
`/v1/models/{id}`), vLLM's `/tokenize`, `/detokenize` and `/version`, `/health`,
`/metrics`, and the API's description (`/openapi.json`, `/docs`) from an AsyncLLM that
the caller owns (starts and shuts down), so an application can mount it next to its own
routes and share the engine. `asyncllm serve` (server.py) runs it on uvicorn with the
engine's life cycle.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import importlib.metadata
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
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncllm.entrypoints.async_llm import AsyncLLM
from asyncllm.entrypoints.openai import responses as R
from asyncllm.entrypoints.openai.metrics import render_metrics
from asyncllm.entrypoints.openai.openapi import docs_page, openapi_document
from asyncllm.entrypoints.openai.protocol import (
    ChatRender,
    OpenAIError,
    Options,
    chat_messages,
    chat_render,
    chat_tools,
    check_context,
    completion_prompts,
    detokenize_tokens,
    field_error,
    sampling_params,
    tokenize_request,
)
from asyncllm.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from asyncllm.frontend.chat_tools import Tools, with_tool_choice
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
        self,
        llm: AsyncLLM,
        model_name: str,
        api_key: str | None,
        max_body_bytes: int,
        chat_template: str | None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.chat_template = chat_template
        self.http_requests: Counter[tuple[str, int]] = Counter()
        self.finished: Counter[str] = Counter()
        self.open: dict[str, str] = {}  # response id -> "stream" or "request", while generating

    # -- plumbing ----------------------------------------------------------------------

    def route(self, path: str, fn: Handler, method: str, v1: bool = False) -> Route:
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
            self.http_requests[(path, response.status_code)] += 1
            return response

        return Route(path, handle, methods=[method])

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
            raise self._no_model(model)
        return body

    def _no_model(self, model: Any) -> OpenAIError:
        return OpenAIError(
            f"the model {model!r} does not exist (this server has {self.model_name!r})",
            404,
            param="model",
            code="model_not_found",
        )

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

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": _version()})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise self._no_model(model_id)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "asyncllm",
            "max_model_len": self._max_model_len(),
        }

    def _max_model_len(self) -> int:
        assert self.llm.config is not None  # (`route` answers 503 unless it runs)
        return self.llm.config.max_model_len

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document(_version(), request.scope.get("root_path", "")))

    async def docs(self, request: Request) -> Response:
        root = request.scope.get("root_path", "")
        return HTMLResponse(docs_page(f"{root}/openapi.json", "asyncllm"))

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        job = tokenize_request(body, self.chat_template)
        if job.messages is not None and job.render is not None:
            tools, _ = chat_tools(body, Options(stream=False, include_usage=False, logprobs=None))
            ids = await self._render(job.messages, job.render, tools)
        else:
            assert job.prompt is not None
            try:
                ids = await self.llm.tokenize(job.prompt, job.add_special_tokens)
            except (ValueError, TypeError) as e:
                raise OpenAIError(str(e), param="prompt") from None
        strs = await self.llm.convert_ids_to_tokens(ids) if job.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self._max_model_len(),
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        tokens = detokenize_tokens(await self._body(request))
        try:
            text = await self.llm.detokenize(tokens)
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param="tokens") from None
        return JSONResponse({"prompt": text})

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
        ids = await self._render(messages, chat_render(body, self.chat_template), tools)
        return await self._serve(request, [ids], params, opts, chat=True, prefix="chatcmpl")

    async def _render(
        self, messages: list[dict[str, Any]], render: ChatRender, tools: Tools | None
    ) -> list[int]:
        """The token ids of a conversation through the chat template."""
        try:
            prompt = await self.llm.render_chat(
                messages,
                render.add_generation_prompt,
                render.template_kwargs,
                tools,
                render.add_special_tokens,
            )
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param="messages") from None
        ids: list[int] = prompt["prompt_token_ids"]
        return ids

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
        """Generates for `prompts` (each refused with vLLM's 400 unless it and max_tokens
        fit the context); a client that leaves before the answer (or, streamed, before
        its first chunk) aborts its requests (the stream's own end does so later)."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        ids = await self._prompt_ids(prompts, params, opts)
        streams = [self.llm.generate({"prompt_token_ids": i}, params) for i in ids]
        # (errors here are still 400/503s)
        firsts = await self._unless_gone(request, _first_outputs(streams, opts.fields), streams)
        if opts.stream:
            chunks = self._chunks(rid, streams, firsts, params.n, opts, chat)
            return StreamingResponse(_sse(chunks), media_type="text/event-stream")
        self.open[rid] = "request"
        try:
            finals = await self._unless_gone(request, _finals(firsts, streams), streams)
        finally:
            del self.open[rid]
        return JSONResponse(self._response(rid, finals, params.n, opts, chat))

    async def _prompt_ids(
        self, prompts: list[Any], params: SamplingParams, opts: Options
    ) -> list[list[int]]:
        """Each prompt's token ids, as generate checks them, and checked to fit the
        context with max_tokens."""
        try:
            ids = await asyncio.gather(*[self.llm.prompt_token_ids(p) for p in prompts])
        except Exception as e:
            raise _engine_error(e, opts.fields) from None
        max_len = self._max_model_len()
        for one in ids:
            check_context(len(one), params.max_tokens, max_len, opts.fields["max_tokens"])
        return ids

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
        self.open[rid] = "stream"
        try:
            async for chunk in self._stream_chunks(rid, streams, firsts, n, opts, chat):
                yield chunk
        finally:
            del self.open[rid]

    async def _stream_chunks(
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


@functools.cache
def _version() -> str:
    """The installed package's version (as `asyncllm --version`)."""
    try:
        return importlib.metadata.version("asyncllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- streams -------------------------------------------------------------------------


def _engine_error(e: Exception, fields: dict[str, str] | None = None) -> OpenAIError:
    """The engine's exception as the API's error (a refusal naming a SamplingParams
    field, or the prompt, names the request's field that set it)."""
    if isinstance(e, ValueError | TypeError):
        return field_error(e, fields or {})
    if isinstance(e, EngineOverloadedError):
        return OpenAIError(str(e), 503, "service_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), 503, "service_unavailable")
    if isinstance(e, RequestFailedError):
        return OpenAIError(str(e), 500, "internal_error")
    raise e


async def _first_outputs(
    streams: list[AsyncGenerator[RequestOutput, None]], fields: dict[str, str]
) -> list[RequestOutput]:
    """Each stream's first output, together; at the first error the others are
    cancelled, every stream is closed (its request aborted), and the error becomes an
    OpenAIError (naming the request's field, from `fields`)."""
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
        raise _engine_error(failures[0], fields) from None
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
    chat_template: str | None = None,
) -> Starlette:
    """The OpenAI-compatible API over a started AsyncLLM (the caller owns its life
    cycle). `model_name` is what /v1/models lists and requests must name (default: the
    engine's model, or "default" for the embedded one); with `api_key`, /v1 routes need
    `Authorization: Bearer <key>`; a request body past `max_body_bytes` is a 413;
    `chat_template` (Jinja text) replaces the model's for chat completions and /tokenize."""
    if not isinstance(llm, AsyncLLM):
        raise TypeError(f"llm must be an AsyncLLM, got {type(llm).__name__}")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
        raise TypeError("max_body_bytes must be an int")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str, got {type(chat_template).__name__}")
    name = model_name or llm.args.model or "default"
    s = OpenAIServer(llm, name, api_key, max_body_bytes, chat_template)
    routes = [
        s.route("/health", s.health, "GET"),
        s.route("/metrics", s.metrics, "GET"),
        s.route("/version", s.version, "GET"),
        s.route("/openapi.json", s.openapi, "GET"),
        s.route("/docs", s.docs, "GET"),
        s.route("/tokenize", s.tokenize, "POST"),
        s.route("/detokenize", s.detokenize, "POST"),
        s.route("/v1/models", s.models, "GET", v1=True),
        s.route("/v1/models/{model_id:path}", s.model, "GET", v1=True),
        s.route("/v1/completions", s.completions, "POST", v1=True),
        s.route("/v1/chat/completions", s.chat_completions, "POST", v1=True),
    ]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.openai_server = s
    return app
