"""Where the throughput benchmark's time goes, step by step: the same workload and
engine flags as `asyncllm.bench.throughput`, with the engine core in this process, and
every `Scheduler.schedule` call timestamped. The gap between consecutive calls is one
step's wall time in steady state (with async scheduling, the step scheduled then is
the one that runs next). Printed: time and steps per decode-batch bucket, the prefill
steps apart, and the mean step time per bucket.

    python3 benchmarks/throughput_timeline.py --model benchmarks/configs/qwen3-0.6b \\
        --load-format dummy --skip-tokenizer-init --dtype bfloat16
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any

from asyncllm.bench import throughput
from asyncllm.bench.common import (
    engine_kwargs,
    num_warmup_requests,
    warmup_requests,
    workload_from_args,
)
from asyncllm.entrypoints.llm import LLM
from asyncllm.sampling_params import SamplingParams

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 1 << 30)


def main(argv: list[str]) -> None:
    args = throughput.parse_args(argv)
    prompts, max_tokens = workload_from_args(args, args.num_prompts)
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m)
        for m in max_tokens
    ]
    llm = LLM(**{**engine_kwargs(args), "multiprocess": False})
    core = llm.engine.client.core
    n_warm = num_warmup_requests(args, llm.engine.config)
    if n_warm:
        llm.generate(*warmup_requests(n_warm, args.temperature), use_tqdm=False)
    llm.reset_prefix_cache()
    log: list[tuple[float, int, int]] = []
    schedule = core.scheduler.schedule

    def timed() -> Any:
        out = schedule()
        log.append((time.perf_counter(), out.num_decode_tokens, out.num_prefill_tokens))
        return out

    core.scheduler.schedule = timed
    for run in range(2):  # the second run: everything compiled, nothing cached
        log.clear()
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        summarize(run, log, elapsed, sum(max_tokens))
    llm.shutdown()


def summarize(run: int, log: list[tuple[float, int, int]], elapsed: float, out_tokens: int) -> None:
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for (t0, dec, pre), (t1, _, _) in zip(log, log[1:]):
        if pre:
            key = "prefill"
        else:
            key = next(f"decode <= {b}" for b in BUCKETS if dec <= b)
        by[key][0] += t1 - t0
        by[key][1] += 1
    print(f"run {run}: {elapsed:.3f} s, {out_tokens / elapsed:.0f} output tok/s, {len(log)} steps")
    print(f"{'bucket':>16} {'steps':>6} {'time s':>8} {'share':>6} {'ms/step':>8}")
    for key in ["prefill"] + [f"decode <= {b}" for b in BUCKETS]:
        if key in by:
            t, n = by[key]
            print(f"{key:>16} {n:>6} {t:8.3f} {t / elapsed:6.1%} {1e3 * t / n:8.3f}")
    first = [
        f"{1e3 * (t1 - t0):.1f} ms ({dec} decode, {pre} prefill tokens)"
        for (t0, dec, pre), (t1, _, _) in list(zip(log, log[1:]))[:12]
    ]
    print("first steps:", "; ".join(first))
    print(json.dumps({"run": run, "elapsed_s": elapsed, "buckets": by}))


if __name__ == "__main__":
    main(sys.argv[1:])
