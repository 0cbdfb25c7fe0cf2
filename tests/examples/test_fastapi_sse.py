"""examples/fastapi_sse.py on uvicorn in this loop (the model-free executor): a full
stream, a client that leaves after its first event, whose request is aborted, and bad
input, each refused with a JSON 4xx naming the field, after which the app still serves."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from urllib.parse import quote

import pytest
import pytest_asyncio

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytestmark = pytest.mark.asyncio(loop_scope="module")

INSTANT = dict(
    device="cpu",
    max_model_len=512,
    distributed_executor_backend="asyncllm.executor.instant:InstantExecutor",
)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_sse.py"


def _load():
    spec = importlib.util.spec_from_file_location("fastapi_sse_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _until(cond, what: str) -> None:
    async with asyncio.timeout(60):
        while not await cond():
            await asyncio.sleep(0.02)  # (polls a condition; the timeout names it)


async def _send(
    port: int, path: str, body: bytes | None = None, content_type: str = "application/json"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A GET of `path`, or a POST of `body` to it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
    if body is not None:
        head = head.replace("GET", "POST", 1)
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    return reader, writer


async def _response(port: int, path: str, body: bytes | None = None, **kw) -> tuple[int, str, str]:
    """(status, content type, body) of a whole response."""
    reader, writer = await _send(port, path, body, **kw)
    raw = (await reader.read()).decode()
    writer.close()
    head, _, text = raw.partition("\r\n\r\n")
    lines = head.split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers.get("content-type", ""), text


async def _events(port: int, path: str, body: bytes | None = None) -> list[dict]:
    """The chunks of a complete stream (which must end with [DONE])."""
    status, ctype, text = await _response(port, path, body)
    assert status == 200 and ctype.startswith("text/event-stream"), (status, text)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    return [json.loads(e) for e in events[:-1]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    """(port, engine) of the example app on uvicorn, one for the module."""
    app = _load().create_app(**INSTANT)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        assert not serving.done(), serving
        return server.started

    await _until(started, "the server to start")
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app.state.llm
    finally:
        server.should_exit = True
        await serving


async def _idle(llm) -> None:
    """Waits until no request is left in the engine, then checks every block is free."""

    async def idle() -> bool:
        stats = await llm.get_stats()
        return stats["num_running"] == 0 and not llm.frontend.has_unfinished_requests()

    await _until(idle, "no request to be left")
    stats = await llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_waiting"] == 0


async def test_streams_tokens_and_aborts_when_the_client_leaves(served):
    port, llm = served
    chunks = await _events(port, "/generate?prompt=Hello&max_tokens=5")
    assert chunks[-1]["finish_reason"] == "length"
    text = "".join(c["text"] for c in chunks)
    assert len(llm.tokenizer(text, add_special_tokens=False).input_ids) >= 1

    reader, writer = await _send(port, "/generate?prompt=Go&max_tokens=400")
    await reader.readuntil(b"data: ")
    writer.close()  # the client leaves after the first event
    await _idle(llm)  # the abandoned request was aborted


LONG = "word " * 600  # more tokens than max_model_len=512
GET_BAD = {  # query -> (status, the field the refusal names)
    "prompt=&max_tokens=5": (422, "prompt"),
    "max_tokens=5": (422, "prompt"),  # missing
    "prompt=Hi&max_tokens=0": (422, "max_tokens"),
    "prompt=Hi&max_tokens=-3": (422, "max_tokens"),
    "prompt=Hi&max_tokens=abc": (422, "max_tokens"),
    "prompt=Hi&max_tokens=2.5": (422, "max_tokens"),
    "prompt=Hi&max_token=5": (422, "max_token"),  # misspelt
    f"prompt=Hi&max_tokens={2**63}": (400, "max_tokens"),  # refused by the engine
    f"prompt={quote(LONG)}&max_tokens=5": (400, "prompt"),  # refused by the engine
}
POST_BAD = {  # body -> (status, the field the refusal names; None: the body itself)
    b'{"prompt": "", "max_tokens": 5}': (422, "prompt"),
    b'{"max_tokens": 5}': (422, "prompt"),
    b'{"prompt": 5}': (422, "prompt"),
    b'{"prompt": null}': (422, "prompt"),
    b'{"prompt": "\\ud800"}': (422, "prompt"),  # a lone surrogate (FastAPI's own 422: a 500)
    b'{"prompt": "Hi", "max_tokens": 0}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_tokens": -1}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_tokens": "5"}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_tokens": true}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_tokens": 1.5}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_tokens": null}': (422, "max_tokens"),
    b'{"prompt": "Hi", "max_token": 5}': (422, "max_token"),
    b'{"prompt": "Hi", "max_tokens": %d}' % 2**63: (400, "max_tokens"),
    b'{"prompt": "%s"}' % LONG.encode(): (400, "prompt"),
    b'{"prompt": "Hi",': (422, None),  # malformed JSON
    b"": (422, None),
    b'["Hi", 5]': (422, None),
    b'{"prompt": "\xff"}': (400, None),  # not UTF-8
}


def _names(status: int, detail, field: str | None) -> bool:
    """Whether a refusal's `detail` names `field` (or, for None, the body)."""
    if status == 400:
        return isinstance(detail, str) and (field is None or detail.startswith(field))
    return any(err["loc"][-1] == field or (field is None and err["loc"][0] == "body")
               for err in detail)  # fmt: skip


async def test_bad_input_is_a_json_4xx_naming_the_field_and_harms_nothing(served):
    port, llm = served
    cases = [(f"/generate?{q}", None, "", want) for q, want in GET_BAD.items()]
    cases += [("/generate", body, "application/json", want) for body, want in POST_BAD.items()]
    cases.append(("/generate", b'{"prompt": "Hi"}', "text/plain", (422, None)))  # not JSON
    for path, body, content_type, (want, field) in cases:
        status, ctype, text = await _response(port, path, body, content_type=content_type)
        case = (path[:60], body and body[:60], status, text[:300])
        assert status == want and ctype == "application/json", case
        assert _names(status, json.loads(text)["detail"], field), case
    # the engine is unharmed: nothing is left in it, and good requests are served
    await _idle(llm)
    for path, body in [
        ("/generate?prompt=Hello&max_tokens=3", None),
        ("/generate", b'{"prompt": "Hello", "max_tokens": 3}'),
    ]:
        chunks = await _events(port, path, body)
        assert chunks[-1]["finish_reason"] == "length" and "".join(c["text"] for c in chunks)
    await _idle(llm)
