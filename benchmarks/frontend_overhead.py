"""Frontend overhead: tokens per second that AsyncLLM delivers when the model costs nothing.

The engine core runs `InstantExecutor` (a fake runner that answers each step at once),
so what is measured is the scheduler, the wire, the output processor, detokenization and
the per-request generators. N consumers each await every yield of their own stream.
Reported: delivered tokens/s, yields per token (below 1 when a consumer's backlog was
merged into one yield), host-process CPU time per delivered token, and the host loop's
lag (a 1 ms ticker's overshoot), p50/p99.

    python benchmarks/frontend_overhead.py --consumers 1 64 512 --tokens 128

Burst mode (`--burst 10000`): that many requests arrive at once, every other one is
cancelled after its first output, twice over; reported per burst: the loop's lag
p50/p99/max, the garbage collector's full collections, and the host's and the engine
core's resident memory before and after (growth after the first burst is the figure
that matters). `--no-gc-freeze` starts the engine with ASYNCLLM_GC_FREEZE=0.

    python benchmarks/frontend_overhead.py --burst 10000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time

from asyncllm import AsyncLLM, RequestOutputKind, SamplingParams
from asyncllm.bench.host import LoopLag, rss_mb

EXECUTOR = "asyncllm.executor.instant:InstantExecutor"


async def run_case(llm: AsyncLLM, consumers: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def consume(i: int) -> tuple[int, int]:
        n = yields = 0
        async for out in llm.generate(f"Consumer {i} says", params):
            yields += 1
            n += len(out.outputs[0].token_ids)
        return n, yields

    async with LoopLag() as lag:
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*[consume(i) for i in range(consumers)])
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    delivered = sum(n for n, _ in results)
    yields = sum(y for _, y in results)
    assert delivered == consumers * tokens, (delivered, consumers * tokens)
    return {
        "consumers": consumers,
        "tokens_per_s": delivered / elapsed,
        "yields_per_token": yields / delivered,
        "host_cpu_us_per_token": cpu / delivered * 1e6,
        "loop_lag_ms_p50": lag.p50_ms(),
        "loop_lag_ms_p99": lag.p99_ms(),
        "seconds": elapsed,
    }


async def run_burst(llm: AsyncLLM, n: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def consume(i: int) -> int:
        got = 0
        async for out in llm.generate(f"Request {i} of the burst says", params):
            got += len(out.outputs[0].token_ids)
            if i % 2:
                break  # cancelled after its first output (aborted in the core)
        return got

    pid = llm.engine_core_pid
    host0, core0 = rss_mb(), rss_mb(pid)
    full_gc_ms: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                full_gc_ms.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    try:
        async with LoopLag() as lag:
            t0 = time.perf_counter()
            done = await asyncio.gather(*[consume(i) for i in range(n)])
            elapsed = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    assert all(d == tokens for d in done[::2]), "a request that was not cancelled got less"
    return {
        "requests": n,
        "seconds": elapsed,
        "loop_lag_ms_p50": lag.p50_ms(),
        "loop_lag_ms_p99": lag.p99_ms(),
        "loop_lag_ms_max": lag.max_ms(),
        "full_collections": len(full_gc_ms),
        "full_collection_ms_max": max(full_gc_ms, default=0.0),
        "host_rss_mb": [host0, rss_mb()],
        "core_rss_mb": [core0, rss_mb(pid)],
    }


async def burst_main(args: argparse.Namespace) -> None:
    if args.no_gc_freeze:
        os.environ["ASYNCLLM_GC_FREEZE"] = "0"
    async with AsyncLLM(
        device="cpu",
        distributed_executor_backend=EXECUTOR,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
    ) as llm:
        await run_case(llm, 4, 8)  # warm-up
        rows = [await run_burst(llm, args.burst, args.tokens) for _ in range(2)]
    print(f"{'burst':>5} {'s':>6} {'lag p50 ms':>11} {'p99 ms':>8} {'max ms':>8} {'full GCs':>9}"
          f" {'longest ms':>10}"
          f" {'host RSS MB':>15} {'core RSS MB':>15}")  # fmt: skip
    for i, r in enumerate(rows):
        h, c = r["host_rss_mb"], r["core_rss_mb"]
        print(f"{i + 1:>5} {r['seconds']:>6.1f} {r['loop_lag_ms_p50']:>11.2f} "
              f"{r['loop_lag_ms_p99']:>8.2f} {r['loop_lag_ms_max']:>8.1f} {r['full_collections']:>9}"
              f" {r['full_collection_ms_max']:>10.1f}"
              f" {h[0]:>7.0f}-{h[1]:<7.0f} {c[0]:>7.0f}-{c[1]:<7.0f}")  # fmt: skip
    growth = {
        "host": rows[1]["host_rss_mb"][1] / rows[0]["host_rss_mb"][1] - 1,
        "core": rows[1]["core_rss_mb"][1] / rows[0]["core_rss_mb"][1] - 1,
    }
    print(
        f"RSS growth after the first burst: host {growth['host']:+.1%}, core {growth['core']:+.1%}"
    )
    print(json.dumps({"benchmark": "frontend_burst", "gc_freeze": not args.no_gc_freeze,
                      "tokens": args.tokens, "rows": rows, "growth": growth}))  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--consumers", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--burst", type=int, help="burst mode: this many requests at once")
    ap.add_argument("--no-gc-freeze", action="store_true", help="burst mode: ASYNCLLM_GC_FREEZE=0")
    args = ap.parse_args()
    if args.burst:
        await burst_main(args)
        return
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
