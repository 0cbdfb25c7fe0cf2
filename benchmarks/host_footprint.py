"""The host process's footprint with an engine core in another process: how long
`from asyncllm import AsyncLLM` takes (fresh interpreters, median), which heavy packages
the host has loaded, its resident memory with a started engine, and after a storm of
requests (many in flight, half cancelled after their first output) once idle again.

    python benchmarks/host_footprint.py --imports 7 --requests 10000 --in-flight 1024

The storm uses the embedded model on the CPU with a few tokens per request: what it
measures is the host (the frontend, collectors, the output handler), not the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from asyncllm.bench.host import rss_mb

HEAVY = ("torch", "transformers", "triton")
IMPORT_CODE = (
    "import time; t = time.perf_counter(); from asyncllm import AsyncLLM; "
    "print(time.perf_counter() - t)"
)
WORDS = "the of and to in a is that for it as was with be by on not he this are or".split()


def import_seconds(n: int) -> list[float]:
    out = []
    for _ in range(n):
        run = subprocess.run([sys.executable, "-c", IMPORT_CODE], capture_output=True, text=True)
        run.check_returncode()
        out.append(float(run.stdout.strip()))
    return out


async def storm(llm: AsyncLLM, n: int, in_flight: int, max_tokens: int) -> int:
    """`n` requests through `in_flight` client tasks (each sends its next request when
    its last one ends, as a server's connections do), every other one cancelled after
    its first output; the tokens received."""
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    requests = iter(range(n))

    async def client() -> int:
        got = 0
        for i in requests:
            prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + i % 13))
            async for out in llm.generate(prompt, params):
                got += len(out.outputs[0].token_ids)
                if i % 2:
                    break  # cancelled after its first output
        return got

    return sum(await asyncio.gather(*[client() for _ in range(in_flight)]))


async def idle_rss(llm: AsyncLLM) -> float:
    """The host's RSS once idle: every request over in the core (a stats call answered
    after them), then the host's own heap trim after that traffic has happened."""
    assert llm.client is not None
    trims = llm.client.heap_trims
    stats = await llm.get_stats()  # answered once the core has taken every abort
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    await llm.client.wait_for_heap_trim(after=trims)
    return rss_mb()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--imports", type=int, default=7)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--in-flight", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    times = import_seconds(args.imports)
    row: dict[str, object] = {
        "import_s_median": round(statistics.median(times), 3),
        "import_s_all": [round(t, 3) for t in times],
        "host_rss_mb_before_engine": round(rss_mb(), 1),
    }
    t = time.perf_counter()
    async with AsyncLLM(device="cpu", max_num_seqs=256) as llm:
        row["start_s"] = round(time.perf_counter() - t, 2)
        row["host_rss_mb_started"] = round(rss_mb(), 1)
        await storm(llm, 64, 64, args.max_tokens)  # first use: lazily built tables
        row["host_rss_mb_warm"] = start = round(await idle_rss(llm), 1)
        t = time.perf_counter()
        tokens = await storm(llm, args.requests, args.in_flight, args.max_tokens)
        row["storm_s"] = round(time.perf_counter() - t, 1)
        row["storm_tokens"] = tokens
        row["host_rss_mb_after_storm_idle"] = end = round(await idle_rss(llm), 1)
        row["host_rss_mb_growth"] = round(end - start, 1)
        row["heavy_modules_in_host"] = sorted(m for m in HEAVY if m in sys.modules)
    print(f"{'measure':34} value")
    for k, v in row.items():
        print(f"{k:34} {v}")
    print(json.dumps(row))


if __name__ == "__main__":
    asyncio.run(main())
