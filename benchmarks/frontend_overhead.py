"""Frontend overhead: tokens per second that AsyncLLM delivers when the model costs nothing.

The engine core runs `InstantExecutor` (a fake runner that answers each step at once),
so what is measured is the scheduler, the wire, the output processor, detokenization and
the per-request generators. N consumers each await every yield of their own stream.
Reported: delivered tokens/s, yields per token (below 1 when a consumer's backlog was
merged into one yield), host-process CPU time per delivered token, and the host loop's
lag (a 1 ms ticker's overshoot), p50/p99.

    python benchmarks/frontend_overhead.py --consumers 1 64 512 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams

EXECUTOR = "asyncllm.executor.instant:InstantExecutor"


async def run_case(llm: AsyncLLM, consumers: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - t - 0.001)

    async def consume(i: int) -> tuple[int, int]:
        n = yields = 0
        async for out in llm.generate(f"Consumer {i} says", params):
            yields += 1
            n += len(out.outputs[0].token_ids)
        return n, yields

    tick = asyncio.create_task(ticker())
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*[consume(i) for i in range(consumers)])
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop.set()
    await tick
    delivered = sum(n for n, _ in results)
    yields = sum(y for _, y in results)
    assert delivered == consumers * tokens, (delivered, consumers * tokens)
    lags.sort()
    return {
        "consumers": consumers,
        "tokens_per_s": delivered / elapsed,
        "yields_per_token": yields / delivered,
        "host_cpu_us_per_token": cpu / delivered * 1e6,
        "loop_lag_ms_p50": statistics.median(lags) * 1e3,
        "loop_lag_ms_p99": lags[int(0.99 * (len(lags) - 1))] * 1e3,
        "seconds": elapsed,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--consumers", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    async with AsyncLLM(
        device="cpu",
        distributed_executor_backend=EXECUTOR,
        max_num_seqs=max(args.consumers),
        max_num_batched_tokens=8192,
        max_model_len=2048,
    ) as llm:
        await run_case(llm, 4, 8)  # warm-up
        rows = [await run_case(llm, c, args.tokens) for c in args.consumers]
    print(
        f"{'consumers':>9} {'tokens/s':>10} {'yields/token':>13} {'host CPU us/token':>18} {'lag p50 ms':>11} {'lag p99 ms':>11}"
    )
    for r in rows:
        print(
            f"{r['consumers']:>9} {r['tokens_per_s']:>10.0f} {r['yields_per_token']:>13.2f} "
            f"{r['host_cpu_us_per_token']:>18.1f} {r['loop_lag_ms_p50']:>11.2f} {r['loop_lag_ms_p99']:>11.2f}"
        )
    print(json.dumps({"benchmark": "frontend_overhead", "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    asyncio.run(main())
