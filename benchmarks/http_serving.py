"""Streams through the OpenAI-compatible server against AsyncLLM directly, one engine.

At each concurrency of --concurrency, that many clients each stream --requests-per-client
chat completions back to back (SSE over HTTP/1.1 to `build_app(llm)` on uvicorn, or
`llm.chat` directly), `--max-tokens` tokens each, EOS ignored through a fixed length:
requests/s, output tokens/s, TTFT and TPOT p50/p99 per mode. Server and clients share
one event loop (the clients' HTTP parsing is counted in the HTTP figures).

    python benchmarks/http_serving.py [--concurrency 1 16 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from asyncllm.bench.common import format_table, percentile

QUESTION = "Write two sentences about the sea, number {}."


async def _direct(llm: AsyncLLM, i: int, max_tokens: int) -> tuple[float, list[float]]:
    params = SamplingParams(
        max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    t0 = time.perf_counter()
    stamps = []
    async for out in llm.chat([{"role": "user", "content": QUESTION.format(i)}], params):
        stamps += [time.perf_counter()] * len(out.outputs[0].token_ids)
    return t0, stamps


async def _http(port: int, i: int, max_tokens: int) -> tuple[float, list[float]]:
    body = json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": QUESTION.format(i)}],
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    stamps = []
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    writer.close()
    return t0, stamps


async def _level(run: Any, clients: int, per_client: int) -> dict[str, float]:
    results: list[tuple[float, list[float]]] = []

    async def client(c: int) -> None:
        for r in range(per_client):
            results.append(await run(c * per_client + r))

    t0 = time.perf_counter()
    await asyncio.gather(*[client(c) for c in range(clients)])
    wall = time.perf_counter() - t0
    ttft = [s[0] - t for t, s in results if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for _, s in results if len(s) > 1]
    tokens = sum(len(s) for _, s in results)
    return {
        "req_s": len(results) / wall,
        "tok_s": tokens / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
    }


async def main() -> None:
    import uvicorn

    from asyncllm.entrypoints.openai.app import build_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    async with AsyncLLM(device=args.device) as llm:
        server = uvicorn.Server(
            uvicorn.Config(build_app(llm), host="127.0.0.1", port=0, log_level="warning")
        )
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        await _level(lambda i: _direct(llm, i, 4), 2, 1)  # warm-up
        rows, result = [], []
        for n in args.concurrency:
            for mode, run in (
                ("AsyncLLM", lambda i: _direct(llm, i, args.max_tokens)),
                ("HTTP", lambda i: _http(port, i, args.max_tokens)),
            ):
                await llm.reset_prefix_cache()
                r = await _level(run, n, args.requests_per_client)
                result.append({"concurrency": n, "mode": mode, **r})
                rows.append(
                    [
                        n,
                        mode,
                        *(f"{v:.1f}" if k.endswith("_s") else f"{v:.0f}" for k, v in r.items()),
                    ]
                )
                print(rows[-1], flush=True)
        server.should_exit = True
        await serving
    header = ["streams", "mode", "req/s", "tok/s", "TTFT p50 ms", "p99", "TPOT p50 ms", "p99"]
    print(format_table(header, rows))
    print(json.dumps({"benchmark": "http_serving", "rows": result}))


if __name__ == "__main__":
    asyncio.run(main())
