"""When each part of a constrained decode step runs on the engine core's step thread:
the median start and end (µs from the step's start) of each timed function over
`--steps` decode steps, at one batch size (the grammar process's accepts and fill show
as the wait for them, `fill_wait`). On CUDA, also the device's side of each step, from
events queued around the forward, a device step's wait for its masks and the sampling:
how long the device ran the forward, waited for the grammar process, masked and
sampled, and sat idle waiting for the host to launch the next step.

The engine runs in this process (`multiprocess=False`); every request is constrained by
the benchmarks' JSON schema (an array of short strings). Functions are wrapped, not
changed; a function that runs more than once a step is listed once per call.

    python benchmarks/structured_timeline.py --device cuda --model DIR --load-format dummy
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import threading
import time
from collections import defaultdict
from typing import Any

import torch

from asyncllm import LLM, SamplingParams, StructuredOutputsParams
from asyncllm.bench.common import ARRAY_SCHEMA, add_engine_args, engine_kwargs, wrap_timed

EVENTS: list[tuple[str, str, float, float]] = []  # (name, thread, start, end)
MARKS: list[tuple[str, Any, Any]] = []  # (name, event before, event after), in launch order


def wrap(obj: Any, name: str, label: str) -> None:
    def record(t0: float, t1: float) -> None:
        EVENTS.append((label, threading.current_thread().name, t0, t1))

    wrap_timed(obj, name, record)


def mark(obj: Any, name: str, label: str) -> None:
    """Queues a timing event on the current stream before and after each call of
    `obj.name` (what the call queued runs between them)."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        try:
            return fn(*args, **kwargs)
        finally:
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            MARKS.append((label, before, after))

    setattr(obj, name, marked)


def device_report() -> None:
    """The device's µs per step: each marked part, and its idle time between
    the end of one step's sampling and the start of the next one's forward."""
    torch.cuda.synchronize()
    steps: list[dict[str, tuple[Any, Any]]] = []
    for label, before, after in MARKS:
        if label == "forward" or not steps:
            steps.append({})
        steps[-1][label] = (before, after)
    steps = steps[5:]
    parts: dict[str, list[float]] = defaultdict(list)
    for step, nxt in zip(steps, steps[1:]):
        for label, (before, after) in step.items():
            parts[label].append(before.elapsed_time(after) * 1e3)
        if "forward" in step and "forward" in nxt:
            parts["period"].append(step["forward"][0].elapsed_time(nxt["forward"][0]) * 1e3)
        if "forward" in step and "mask_apply" in step:  # (the wait for the masks' copy)
            parts["to_masks"].append(step["forward"][1].elapsed_time(step["mask_apply"][0]) * 1e3)
        if "sample" in step and "forward" in nxt:
            parts["idle"].append(step["sample"][1].elapsed_time(nxt["forward"][0]) * 1e3)
    print(f"device, µs over {len(steps) - 1} steps: median, mean, 90th percentile")
    for label, values in parts.items():
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(
            f"  {label:12s} {statistics.median(values):8.0f} {statistics.fmean(values):8.0f}"
            f" {p90:8.0f}  (n={len(values)})"
        )


def kernel_report(core: Any, encoder: Any, steps: int) -> None:
    """Runs `steps` more steps under torch.profiler and prints each device kernel's and
    copy's time a step (µs), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            encoder.encode(core.step())
        torch.cuda.synchronize()
    rows = [
        (e.self_device_time_total / steps, e.count / steps, e.key)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    print(f"device time a step over {steps} profiled steps, µs (calls a step):")
    for t, calls, key in sorted(rows, reverse=True)[:40]:
        print(f"  {t:8.1f}  ({calls:4.1f})  {key[:110]}")
    print(f"  {sum(t for t, _, _ in rows):8.1f}  in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap, device="cuda", dtype="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--free", action="store_true", help="no constraint, for comparison")
    ap.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="then N more steps under torch.profiler: the device time of each kernel and copy a step",
    )
    args = ap.parse_args()
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", args.batch)
    kwargs.setdefault("max_model_len", 512)
    llm = LLM(multiprocess=False, **kwargs)
    from asyncllm.engine.serial import Encoder
    from asyncllm.structured.manager import FillJob
    from asyncllm.worker.step_result import StepResult

    engine = llm.engine
    core = engine.client.core
    runner = core.executor.worker.runner
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        max_tokens=args.steps + args.kernels + 16,
        structured_outputs=None if args.free else StructuredOutputsParams(json=ARRAY_SCHEMA),
    )
    for _ in range(args.batch):
        prompt = [rng.randint(0, 4000) for _ in range(64)]
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": prompt}, params)
    for _ in range(12):
        engine.step()  # prefills, warm decode steps
    sched, struct = core.scheduler, core.structured
    from asyncllm.sample import ops, sampler
    from asyncllm.worker import step_sampler
    from asyncllm.worker.grammar_handshake import GrammarHandshake
    from asyncllm.worker.input_batch import InputBatch
    from asyncllm.worker.mask_staging import MaskStaging
    from asyncllm.worker.sampling_state import SamplingState

    wrap(struct, "take_bitmask", "take_bitmask")
    if torch.cuda.is_available():
        wrap(torch.cuda.Event, "synchronize", "event_sync")
        wrap(torch.cuda.Event, "query", "event_query")
    wrap(MaskStaging, "to_device", "mask_to_device")
    wrap(ops, "apply_token_bitmask", "mask_kernel")
    wrap(sampler.Sampler, "__call__", "sampler")
    wrap(SamplingState, "metadata", "sampling_metadata")
    wrap(SamplingState, "record_sampled", "record_sampled")
    wrap(step_sampler, "to_host", "to_host")
    wrap(InputBatch, "take_sampled_tokens", "take_sampled")
    wrap(sched, "_build_output", "build_output")
    wrap(sched, "_schedule_running", "schedule_running")
    wrap(sched, "schedule", "schedule")
    wrap(sched, "update_from_output", "update")
    wrap(sched, "plan_grammar_fill", "plan_grammar_fill")
    wrap(sched.grammar, "give_grammar_tokens", "give_grammar_tokens")
    wrap(struct, "accept", "accept")
    wrap(struct, "start_fill", "start_fill")
    wrap(FillJob, "give_tokens", "give_tokens")
    wrap(FillJob, "wait", "fill_wait")
    wrap(runner.grammar, "apply_bitmask", "mask")
    wrap(runner, "_sample", "sample")
    wrap(runner, "_update_states", "update_states")
    wrap(runner, "_prepare_inputs", "prepare_inputs")
    wrap(runner, "_run_model", "forward")
    wrap(StepResult, "apply", "result_wait")
    wrap(GrammarHandshake, "give_tokens", "give_tokens_device")
    wrap(GrammarHandshake, "wait_for_masks", "wait_for_masks")
    wrap(core, "_finish_fill", "finish_fill")
    if torch.cuda.is_available():
        mark(runner, "_run_model", "forward")
        mark(GrammarHandshake, "wait_for_masks", "mask_wait")
        mark(runner, "_sample", "sample")
        mark(runner.grammar, "apply_bitmask", "mask_apply")
        mark(runner, "_prepare_inputs", "prepare")
        mark(GrammarHandshake, "give_tokens", "hand_over")
    encoder = Encoder()
    wrap(encoder, "encode", "encode")
    starts = []
    for _ in range(args.steps):
        starts.append(time.perf_counter())
        encoder.encode(core.step())
    starts.append(time.perf_counter())
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    calls: dict[tuple[int, str], int] = defaultdict(int)  # (step, name@thread) -> calls so far
    for name, thread, t0, t1 in sorted(EVENTS, key=lambda e: e[2]):
        i = next((i for i in range(args.steps) if starts[i] <= t0 < starts[i + 1]), None)
        if i is None or i < 5:  # (the first steps after wrapping left out)
            continue
        key = f"{name}@{thread}"
        k = calls[i, key]
        calls[i, key] += 1
        per[f"{key}#{k}"].append(((t0 - starts[i]) * 1e6, (t1 - starts[i]) * 1e6))
    step = statistics.median(b - a for a, b in zip(starts[5:-1], starts[6:])) * 1e6
    print(f"batch {args.batch}: median step {step:.0f} µs")
    rows = []
    for key, spans in per.items():
        rows.append(
            (
                statistics.median(a for a, _ in spans),
                statistics.median(b for _, b in spans),
                key,
                len(spans),
            )
        )
    for a, b, key, n in sorted(rows):
        print(f"{a:8.0f} {b:8.0f} {b - a:7.0f}  {key}  (n={n})")
    if torch.cuda.is_available():
        device_report()
        if args.kernels:
            kernel_report(core, encoder, args.kernels)
    llm.shutdown()


if __name__ == "__main__":
    main()
