"""The host process never loads the core side: after a whole AsyncLLM session on the
embedded model (start, generate, chat, abort, stats, a request through the OpenAI app,
shutdown), torch, transformers and triton are not in its `sys.modules`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SESSION = textwrap.dedent(
    """
    import asyncio, json, sys
    from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
    from asyncllm.entrypoints.openai.app import build_app

    async def post(app, path, payload):
        body = json.dumps(payload).encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }
        given = asyncio.Event()
        async def receive():
            if not given.is_set():
                given.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # (no disconnect: cancelled when the reply ends)
        parts = {"status": None, "body": b""}
        async def send(message):
            if message["type"] == "http.response.start":
                parts["status"] = message["status"]
            elif message["type"] == "http.response.body":
                parts["body"] += message.get("body", b"")
        await app(scope, receive, send)
        return parts["status"], json.loads(parts["body"])

    async def main():
        result = {}
        async with AsyncLLM(device="cpu", max_model_len=512) as llm:
            greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outs = [o async for o in llm.generate("Hello!", greedy)]
            result["generate"] = len(outs[-1].outputs[0].token_ids)
            outs = [o async for o in llm.chat([{"role": "user", "content": "Hi"}], greedy)]
            result["chat"] = len(outs[-1].outputs[0].token_ids)
            stream = llm.generate(
                "Count to a hundred:",
                SamplingParams(max_tokens=200, ignore_eos=True,
                               output_kind=RequestOutputKind.DELTA),
                request_id="long",
            )
            first = await stream.__anext__()
            await llm.abort("long")
            rest = [o async for o in stream]
            result["aborted"] = (rest or [first])[-1].outputs[0].finish_reason
            stats = await llm.get_stats()
            result["idle"] = stats["num_running"] == stats["num_waiting"] == 0
            status, reply = await post(build_app(llm), "/v1/chat/completions", {
                "model": "default", "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hi"}],
            })
            result["server"] = [status, reply["usage"]["completion_tokens"]]
        result["loaded"] = sorted(
            m for m in ("torch", "transformers", "triton", "xgrammar") if m in sys.modules
        )
        print(json.dumps(result))

    asyncio.run(main())
    """
)


def test_a_whole_async_session_leaves_torch_transformers_and_triton_unloaded():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "kernels")]),
        "HF_HUB_OFFLINE": "1",
    }
    run = subprocess.run(
        [sys.executable, "-c", SESSION], capture_output=True, text=True, env=env, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {
        "generate": 4,
        "chat": 4,
        "aborted": "abort",
        "idle": True,
        "server": [200, 3],
        "loaded": [],
    }, result
