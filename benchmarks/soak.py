"""Memory soak with the real embedded model on the CPU: waves of requests through
AsyncLLM, every other one cancelled after its first output; after each wave, the idle
engine core's and the host's resident memory. Prompts and output lengths vary, so steps come
in many shapes (a model's CPU kernels may cache work per input shape).

    python benchmarks/soak.py --waves 8 --requests 250
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from asyncllm.bench.host import rss_mb
from asyncllm.engine.core_main import TRIM_AFTER_IDLE_S

WORDS = "the of and to in a is that for it as was with be by on not he this are or".split()


async def wave(llm: AsyncLLM, n: int, rng: random.Random) -> int:
    async def one(i: int) -> int:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))
        params = SamplingParams(
            max_tokens=rng.randint(4, 48), temperature=0.8, output_kind=RequestOutputKind.DELTA
        )
        got = 0
        async for out in llm.generate(prompt, params):
            got += len(out.outputs[0].token_ids)
            if i % 2:
                break  # cancelled after its first output
        return got

    return sum(await asyncio.gather(*[one(i) for i in range(n)]))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--requests", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    async with AsyncLLM(device="cpu") as llm:
        pid = llm.engine_core_pid
        start = {"core_rss_mb": rss_mb(pid), "host_rss_mb": rss_mb()}
        for w in range(args.waves):
            t = time.perf_counter()
            tokens = await wave(llm, args.requests, rng)
            # A stats call is answered once the core has gone idle; it returns its freed
            # heap memory once idle for TRIM_AFTER_IDLE_S: the RSS below is the idle core's.
            stats = await llm.get_stats()
            assert stats["num_running"] == stats["num_waiting"] == 0, stats
            await asyncio.sleep(TRIM_AFTER_IDLE_S + 1.0)
            rows.append(
                {
                    "wave": w + 1,
                    "seconds": time.perf_counter() - t,
                    "tokens": tokens,
                    "core_rss_mb": rss_mb(pid),
                    "host_rss_mb": rss_mb(),
                }
            )
            r = rows[-1]
            print(
                f"wave {r['wave']:2d}: {r['seconds']:6.1f} s, {tokens:6d} tokens, core RSS "
                f"{r['core_rss_mb']:7.0f} MB, host RSS {r['host_rss_mb']:6.0f} MB",
                flush=True,
            )
    growth = rows[-1]["core_rss_mb"] / rows[0]["core_rss_mb"] - 1
    print(
        f"core RSS: {start['core_rss_mb']:.0f} MB at start, growth after the first wave {growth:+.1%}"
    )
    print(json.dumps({"benchmark": "soak", "start": start, "rows": rows, "core_growth": growth}))


if __name__ == "__main__":
    asyncio.run(main())
