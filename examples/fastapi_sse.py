"""A FastAPI endpoint of your own that streams tokens over server-sent events.

The engine lives as long as the app (FastAPI's lifespan). When the client goes away,
Starlette stops iterating the response: the `async for` over `llm.generate` is left,
which closes the generator and aborts the request in the engine.

Bad input never reaches the stream: FastAPI checks the fields against `Generate` (a
422 naming the field), and what the engine still refuses (a ValueError or TypeError
naming the field, such as a prompt longer than the model's context) is a 400.

    pip install fastapi uvicorn
    uvicorn examples.fastapi_sse:app --port 8001
    curl -N 'http://127.0.0.1:8001/generate?prompt=Hello&max_tokens=32'
    curl -N http://127.0.0.1:8001/generate -H 'content-type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 32}'
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams


class Generate(BaseModel):
    """A request's fields (query parameters of a GET)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=1)


class GenerateJSON(Generate):
    """The same as a POST's JSON body, where types are exact: "5" and true are not 5."""

    model_config = ConfigDict(strict=True)


async def sse(llm: AsyncLLM, req: Generate) -> StreamingResponse:
    """The answer to `req` as server-sent events (an error before the first one: a 400)."""
    try:
        params = SamplingParams(max_tokens=req.max_tokens, output_kind=RequestOutputKind.DELTA)
        stream = llm.generate(req.prompt, params)
        first = await anext(stream)  # a prompt the engine refuses raises here
    except (ValueError, TypeError) as e:  # bad input, named by the engine
        raise HTTPException(status_code=400, detail=str(e)) from None

    async def events() -> AsyncIterator[str]:
        try:
            out = first
            while True:
                c = out.outputs[0]
                yield f"data: {json.dumps({'text': c.text, 'finish_reason': c.finish_reason})}\n\n"
                if out.finished:
                    break
                out = await anext(stream)
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # the client left early: the request is aborted

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(**engine_args: Any) -> FastAPI:
    """The app; `engine_args` go to AsyncLLM (none: the embedded model)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncLLM(**engine_args) as llm:
            app.state.llm = llm
            yield

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422, less the inputs it echoes (a JSON "\ud800" would not encode)
        errors = [{k: v for k, v in err.items() if k != "input"} for err in e.errors()]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    @app.get("/generate")
    async def generate(request: Request, req: Annotated[Generate, Query()]) -> StreamingResponse:
        return await sse(request.app.state.llm, req)

    @app.post("/generate")
    async def generate_json(request: Request, req: GenerateJSON) -> StreamingResponse:
        return await sse(request.app.state.llm, req)

    return app


app = create_app()
