"""A FastAPI endpoint of your own that streams tokens over server-sent events.

The engine lives as long as the app (FastAPI's lifespan). When the client goes away,
Starlette stops iterating the response: the `async for` over `llm.generate` is left,
which closes the generator and aborts the request in the engine.

    pip install fastapi uvicorn
    uvicorn examples.fastapi_sse:app --port 8001
    curl -N 'http://127.0.0.1:8001/generate?prompt=Hello&max_tokens=32'
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams


def create_app(**engine_args: Any) -> FastAPI:
    """The app; `engine_args` go to AsyncLLM (none: the embedded model)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncLLM(**engine_args) as llm:
            app.state.llm = llm
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/generate")
    async def generate(request: Request, prompt: str, max_tokens: int = 64) -> StreamingResponse:
        llm: AsyncLLM = request.app.state.llm
        params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
        stream = llm.generate(prompt, params)
        first = await anext(stream)  # a bad prompt raises here, before the response starts

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

    return app


app = create_app()
