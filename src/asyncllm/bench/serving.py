"""Online serving: AsyncLLM under Poisson arrivals, one engine for every rate.

At each rate of --rates (requests/s; `inf` sends everything at once) --num-requests
requests of the throughput workload (random token-id prompts, each with its own
max_tokens, temperature 0.6, EOS ignored) arrive with exponential gaps (seeded) and
stream DELTA outputs. Per request: TTFT (until the first output with a token), TPOT
((last token time - first token time) / (tokens - 1)) and end-to-end latency. Per rate:
p50/p99 of each, requests/s and output tokens/s over the time from the first arrival
to the last completion. Before the first rate a warm-up runs (on CUDA, max_num_seqs short
requests ending one a step); the prefix cache is emptied before each rate.

    python -m asyncllm.bench.serving --model benchmarks/configs/qwen3-0.6b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --rates 4 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from asyncllm.bench.common import (
    NUM_PROMPTS,
    add_warmup_arg,
    add_workload_args,
    benchmark_parser,
    check_output_tokens,
    describe_engine,
    engine_kwargs,
    format_table,
    num_warmup_requests,
    percentile,
    report,
    warmup_requests,
    workload_from_args,
)
from asyncllm.entrypoints.async_llm import AsyncLLM
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

ENGINE_DEFAULTS = {"max_model_len": 4096, "max_num_seqs": 256, "max_num_batched_tokens": 16384}


@dataclass
class RequestRecord:
    output_tokens: int
    ttft: float  # seconds from sending to the first output token
    tpot: float  # seconds per output token after the first; NaN with one token
    e2e: float
    end: float  # perf_counter() when the last output came


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = benchmark_parser("serving", __doc__, **ENGINE_DEFAULTS)
    add_workload_args(parser, "--num-requests", NUM_PROMPTS)
    add_warmup_arg(parser)
    parser.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[4.0, 16.0, 64.0],
        help="arrival rates in requests/s, one run each; inf: all at once (default 4 16 64)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)"
    )
    args = parser.parse_args(argv)
    if any(not r > 0 for r in args.rates):
        parser.error("--rates must be positive")
    return args


async def _one(
    llm: AsyncLLM, prompt: list[int], params: SamplingParams, start: float
) -> RequestRecord:
    """Streams one request sent at `start` (its arrival time, perf_counter())."""
    first = last = math.nan
    tokens = 0
    async for out in llm.generate({"prompt_token_ids": prompt}, params):
        n = len(out.outputs[0].token_ids)
        if n:
            now = time.perf_counter()
            if tokens == 0:
                first = now
            last = now
            tokens += n
    end = time.perf_counter()
    tpot = (last - first) / (tokens - 1) if tokens > 1 else math.nan
    return RequestRecord(tokens, first - start, tpot, end - start, end)


async def _drain(llm: AsyncLLM, prompt: Any, params: SamplingParams) -> None:
    async for _ in llm.generate(prompt, params):
        pass


async def run_rate(
    llm: AsyncLLM,
    prompts: list[list[int]],
    max_tokens: list[int],
    rate: float,
    seed: int,
    temperature: float,
) -> dict[str, Any]:
    """Sends every request at its Poisson arrival time and waits for all of them."""
    rng = random.Random(seed)
    tasks = []
    start = next_arrival = time.perf_counter()
    for prompt, m in zip(prompts, max_tokens, strict=True):
        delay = next_arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        params = SamplingParams(
            temperature=temperature,
            ignore_eos=True,
            max_tokens=m,
            output_kind=RequestOutputKind.DELTA,
        )
        tasks.append(asyncio.create_task(_one(llm, prompt, params, time.perf_counter())))
        next_arrival += rng.expovariate(rate)
    records: list[RequestRecord] = await asyncio.gather(*tasks)
    duration = max(r.end for r in records) - start
    output_tokens = sum(r.output_tokens for r in records)
    check_output_tokens(output_tokens, sum(max_tokens))
    ttft = [r.ttft * 1e3 for r in records]
    tpot = [r.tpot * 1e3 for r in records if not math.isnan(r.tpot)]
    e2e = [r.e2e * 1e3 for r in records]
    return {
        "rate": rate,
        "num_requests": len(records),
        "duration_s": duration,
        "request_throughput": len(records) / duration,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "ttft_ms_mean": sum(ttft) / len(ttft),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p99": percentile(tpot, 99),
        "e2e_ms_p50": percentile(e2e, 50),
        "e2e_ms_p99": percentile(e2e, 99),
    }


async def _run(
    args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = []
    async with AsyncLLM(**engine_kwargs(args)) as llm:
        assert llm.config is not None
        engine = describe_engine(llm.config)
        warm_prompts, warm_params = warmup_requests(
            num_warmup_requests(args, llm.config), args.temperature
        )
        await asyncio.gather(*(_drain(llm, p, sp) for p, sp in zip(warm_prompts, warm_params)))
        for rate in args.rates:
            if not await llm.reset_prefix_cache():  # each rate prefills its prompts afresh
                raise RuntimeError("the prefix cache could not be emptied (blocks still held)")
            rows.append(await run_rate(llm, prompts, max_tokens, rate, args.seed, args.temperature))
    return engine, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    prompts, max_tokens = workload_from_args(args, args.num_requests)
    engine, rows = asyncio.run(_run(args, prompts, max_tokens))
    result = {
        "benchmark": "serving",
        "engine": engine,
        "num_requests": args.num_requests,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens_per_rate": sum(max_tokens),
        "rates": rows,
    }
    table = format_table(
        [
            "rate req/s",
            "req/s",
            "output tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "e2e p50 ms",
            "e2e p99 ms",
        ],
        [
            [
                f"{r['rate']:g}",
                r["request_throughput"],
                r["output_tok_s"],
                r["ttft_ms_p50"],
                r["ttft_ms_p99"],
                r["tpot_ms_p50"],
                r["tpot_ms_p99"],
                r["e2e_ms_p50"],
                r["e2e_ms_p99"],
            ]
            for r in rows
        ],
    )
    title = (
        f"serving: {engine['model']} ({engine['architecture']}), {engine['dtype']} on "
        f"{engine['device']} ({engine['device_name']}), {args.num_requests} requests per rate, "
        f"Poisson arrivals, temperature {args.temperature}, EOS ignored"
    )
    return report(title, table, result)


if __name__ == "__main__":
    main()
