"""Host cost of one engine step's bookkeeping: Scheduler.schedule() + update_from_output().

`--requests` requests (default 256) with `--prompt-len`-token prompts (default 128) are
prefilled, then decode one token per step; after warm-up, `--steps` decode steps are
timed. Only schedule() and update_from_output() are timed, each on its own: the fake
model runner (one token per request) runs between the two timers. No model, no torch.
Prints a table (µs per step) and one JSON line. Target: under 1000 µs per step.

    python benchmarks/scheduler_overhead.py
    python benchmarks/scheduler_overhead.py --profile   # cProfile of the timed steps
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import random
import statistics
import sys
import time

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.kv_cache_utils import BlockHasher
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from asyncllm.sampling_params import SamplingParams
from asyncllm.step_io import ModelRunnerOutput, SchedulerOutput

TARGET_US = 1000.0


def fake_runner(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """One token for each request whose prompt is fully computed; none mid-prefill."""
    requests = scheduler.requests
    sampled: dict[str, list[int]] = {}
    for rid in out.num_scheduled_tokens:
        req = requests[rid]
        sampled[rid] = (
            [req.num_tokens % 1000 + 1] if req.num_computed_tokens >= req.num_tokens else []
        )
    return ModelRunnerOutput(sampled_token_ids=sampled)


def build(args: argparse.Namespace) -> Scheduler:
    timed = args.steps * (2 if args.profile else 1)  # no request may finish while timed
    max_model_len = args.prompt_len + args.warmup_steps + timed + 64
    blocks_per_request = -(-max_model_len // args.block_size)
    kv = KVCacheManager(
        num_blocks=args.requests * blocks_per_request + 1,  # never preempts
        block_size=args.block_size,
        max_model_len=max_model_len,
        enable_caching=True,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        kv,
    )
    rng = random.Random(0)
    hasher = BlockHasher(args.block_size)
    for i in range(args.requests):
        prompt = [rng.randrange(1, 32000) for _ in range(args.prompt_len)]
        scheduler.add_request(
            Request(
                f"req-{i}",
                prompt,
                SamplingParams(max_tokens=max_model_len),
                eos_token_id=None,  # nothing may finish while we time
                max_tokens=max_model_len,
                arrival_time=float(i),
                block_hasher=hasher,
            )
        )
    return scheduler


def warm_up(scheduler: Scheduler, args: argparse.Namespace) -> int:
    """Steps until every request decodes, then `--warmup-steps` decode steps more."""
    steps = 0
    all_decoding = 0
    while all_decoding < args.warmup_steps:
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_runner(scheduler, out))
        steps += 1
        if out.num_decode_tokens == args.requests and out.num_prefill_tokens == 0:
            all_decoding += 1
        if steps > 10_000:
            sys.exit("warm-up never reached a step where every request decodes")
    return steps


def timed_steps(scheduler: Scheduler, n: int, n_requests: int) -> tuple[list[float], list[float]]:
    sched_us: list[float] = []
    update_us: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        runner_out = fake_runner(scheduler, out)  # not timed
        t2 = clock()
        outputs = scheduler.update_from_output(out, runner_out)
        t3 = clock()
        sched_us.append((t1 - t0) / 1e3)
        update_us.append((t3 - t2) / 1e3)
        if out.num_decode_tokens != n_requests or len(outputs) != n_requests:
            sys.exit(
                f"a timed step was not {n_requests} decodes: {out.num_decode_tokens} decode "
                f"and {out.num_prefill_tokens} prefill tokens, {len(outputs)} outputs"
            )
    return sched_us, update_us


def summary(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "mean": round(statistics.fmean(s), 1),
        "p50": round(s[len(s) // 2], 1),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--warmup-steps", type=int, default=20, help="decode steps before timing")
    ap.add_argument("--steps", type=int, default=500, help="timed decode steps")
    ap.add_argument("--profile", action="store_true", help="also cProfile the timed steps")
    args = ap.parse_args()

    scheduler = build(args)
    warmup = warm_up(scheduler, args)
    gc.collect()
    sched_us, update_us = timed_steps(scheduler, args.steps, args.requests)
    total_us = [a + b for a, b in zip(sched_us, update_us)]
    rows = {"schedule": summary(sched_us), "update": summary(update_us), "total": summary(total_us)}

    print(
        f"scheduler overhead: {args.requests} requests decoding, prompt {args.prompt_len}, "
        f"block {args.block_size}, {args.steps} timed steps after {warmup} warm-up steps; "
        f"Python {platform.python_version()} on {platform.processor() or platform.machine()}"
    )
    print(f"{'µs/step':>10} {'mean':>9} {'p50':>9} {'p99':>9}")
    for name, r in rows.items():
        print(f"{name:>10} {r['mean']:>9.1f} {r['p50']:>9.1f} {r['p99']:>9.1f}")
    print(f"target: total mean under {TARGET_US:.0f} µs/step")
    print(
        json.dumps(
            {
                "benchmark": "scheduler_overhead",
                "requests": args.requests,
                "prompt_len": args.prompt_len,
                "block_size": args.block_size,
                "steps": args.steps,
                "schedule_us": rows["schedule"],
                "update_us": rows["update"],
                "total_us": rows["total"],
                "target_us": TARGET_US,
                "meets_target": rows["total"]["mean"] < TARGET_US,
                "python": platform.python_version(),
            }
        )
    )

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        timed_steps(scheduler, args.steps, args.requests)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
