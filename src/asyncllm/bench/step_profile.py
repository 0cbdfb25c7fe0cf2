"""Where one decode step's time goes, at a given batch size, in µs per step.

The engine runs in this process (`multiprocess=False`); `--batch` requests of
`--input-len` random tokens are prefilled, then `--steps` decode steps are timed. Host
stages are wall times of the engine's own functions (wrapped, not changed):

- schedule: `Scheduler.schedule`
- prepare: the runner's batch update and input buffers (`_update_states`, `_prepare_inputs`)
- forward: launching the model (a CUDA-graph replay or eager launches)
- sample: queuing the sampling and the copy of the tokens to the host
- wait: waiting for a step's tokens and applying them to the persistent batch
  (`StepResult.apply`); with async scheduling the step waited for is the previous one
- update: the scheduler taking the step's tokens (`update_from_output`)
- fill: with `--structured`, sending a step's accepts and bitmask fill to the grammar
  process (`Scheduler.plan_grammar_fill`, then the tokens ahead of it:
  `give_grammar_tokens`; a bitmask filled at scheduling time counts in "schedule"),
  and waiting for its answer (`FillJob.wait`)
- mask: with `--structured`, the runner masking the logits with the bitmask
  (`GrammarRows.apply_bitmask`: the copy to the device and the masking kernels' launch)
- encode: serializing the step's outputs for the wire (`Encoder.encode`), as the
  engine-core process does before sending them to the frontend's process
- other: the rest of `EngineCore.step` (the core's bookkeeping, output objects)

By default the timed steps are the core's own (`EngineCore.step`, then the encoding),
as the engine-core process runs them: the frontend (detokenizing, `RequestOutput`s) runs
in the host's process, never on the core's thread. `--inline-frontend` times
`LLMEngine.step` instead, with the frontend on the core's thread (stage "frontend",
`Frontend.process_outputs`), as `LLM(multiprocess=False)` runs.

The stages are timed without a profiler; a second run of as many steps under
`torch.profiler` gives the device side (CUDA only, read from its Chrome trace): `gpu`,
the sum of the step's kernel times, and the kernels that take most of it; the device's
idle time between consecutive steps and in all (`device_gaps`); and `replay`, one replay
of the step's decode graph alone between CUDA events (launch gaps included); and the kernels' time by class (GEMMs, attention, elementwise,
sampling, other: `asyncllm.bench.kernel_classes`) beside each class's floor for the
step, on a card whose rates the roofline knows (or `--hbm-bandwidth`, `--peak-flops`).
`--input-len` takes several prompt lengths (a row for each batch at each), and
`--mixed N` prefills a new request of N tokens beside the decodes in every timed step
(a mixed step). `--cprofile FILE` writes Python-level
stats of the timed steps, `--trace-dir DIR` each batch's Chrome trace. `--structured`
constrains every request with the benchmarks' JSON schema (an array of 64 short
strings; it needs the tokenizer).

    python -m asyncllm.bench.step_profile --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --batch 1 256

Without a GPU, `--model benchmarks/configs/tiny-qwen3 --device cpu` (two layers of
width 64) keeps the model's share small, so the host's stages stand out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm.bench.common import (
    ARRAY_SCHEMA,
    add_engine_args,
    add_peak_rate_args,
    engine_kwargs,
    wrap_timed,
)
from asyncllm.bench.kernel_classes import KERNEL_CLASSES, class_floors, class_times
from asyncllm.bench.roofline import DTYPE_BYTES, ModelShape, rates_from_args

STEP_MARK = "asyncllm.step"
STAGES = (
    "schedule",
    "prepare",
    "forward",
    "fill",
    "mask",
    "sample",
    "wait",
    "update",
    "encode",
    "frontend",
)


def _wrap(obj: Any, name: str, stage: str, times: dict[str, float]) -> Callable[[], None]:
    """Times `obj.name` into `times[stage]`; returns the undo."""

    def add(t0: float, t1: float) -> None:
        times[stage] += t1 - t0

    return wrap_timed(obj, name, add)


def record_steps(scheduler: Any) -> tuple[list[tuple[list[tuple[int, int]], int]], Any]:
    """Records what each step `scheduler.schedule()` makes computes (per request, its
    tokens and the keys they attend to; how many sample) until the undo is called."""
    planned: list[tuple[list[tuple[int, int]], int]] = []
    schedule = scheduler.schedule

    def recording() -> Any:
        sched = schedule()
        if sched.total_num_scheduled_tokens:
            reqs = scheduler.requests
            rows = [(n, reqs[r].num_computed_tokens) for r, n in sched.num_scheduled_tokens.items()]
            planned.append((rows, len(scheduler.sampling_requests(sched))))
        return sched

    scheduler.schedule = recording
    return planned, lambda: setattr(scheduler, "schedule", schedule)


def _time_replay(runner: Any, batch: int) -> float | None:
    """µs of one replay of the batch's decode graph alone, between CUDA events (median
    of 20). The step buffers still hold the last step's inputs, so each replay rewrites
    the same K/V into the same slots: nothing changes."""
    import statistics

    import torch

    from asyncllm.worker.step_buffers import padded_size

    if runner.graphs is None or (size := padded_size(batch, runner.capture_sizes)) is None:
        return None
    times = []
    for _ in range(21):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.graphs.replay(size)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[1:])


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_gaps(events: list[dict[str, Any]], mark: str = STEP_MARK) -> dict[str, float]:
    """How long the device sat idle in a Chrome trace of consecutive steps.

    Each device event (kernel, copy, memset) belongs to the step whose host-side `mark`
    range holds the runtime call that launched it (matched by correlation id). Over the
    steps with device events: `between_us`, the idle time between the last device event
    of one step and the first of the next, per step boundary; `between_frac`, that idle
    time over the span from the first step's first event to the last step's last event;
    `idle_frac`, all idle time in that span (between and inside steps) over the span.
    """
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name") == mark and e.get("ph") == "X" and e.get("cat") == "user_annotation"
    )
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        if ts is None:
            continue
        for i, (start, end) in enumerate(steps):
            if start <= ts <= end:
                groups[i].append((e["ts"], e["ts"] + e["dur"]))
                break
    order = sorted(groups)
    if len(order) < 2:
        return {"between_us": 0.0, "between_frac": 0.0, "idle_frac": 0.0, "steps": len(order)}
    spans = [(min(a for a, _ in groups[i]), max(b for _, b in groups[i])) for i in order]
    total = spans[-1][1] - spans[0][0]
    between = sum(max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(spans, spans[1:]))
    busy, reach = 0.0, spans[0][0]
    for a, b in sorted(iv for i in order for iv in groups[i]):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return {
        "between_us": between / (len(order) - 1),
        "between_frac": between / total,
        "idle_frac": (total - busy) / total,
        "steps": len(order),
    }


def profile_batch(
    llm: Any,
    batch: int,
    input_len: int,
    steps: int,
    seed: int,
    cprofile: Any = None,
    trace_dir: str | None = None,
    inline_frontend: bool = False,
    structured: bool = False,
    mixed: int = 0,
    rates: Any = None,
    top_kernels: int = 8,
) -> dict[str, Any]:
    """One row: `batch` requests decoding after prompts of `input_len`; with `mixed`,
    every timed step also prefills a new request of that many tokens."""
    import torch

    from asyncllm import SamplingParams, StructuredOutputsParams
    from asyncllm.engine.serial import Encoder
    from asyncllm.structured.manager import FillJob
    from asyncllm.worker.step_result import StepResult

    engine = llm.engine
    core = engine.client.core
    runner = core.executor.worker.runner
    rng = random.Random(seed)
    constraint = StructuredOutputsParams(json=ARRAY_SCHEMA) if structured else None
    params = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        max_tokens=steps + 16,
        structured_outputs=constraint,
    )
    for _ in range(batch):
        prompt = [rng.randint(0, 4000) for _ in range(input_len)]
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": prompt}, params)
    while len(core.scheduler.waiting) or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in core.scheduler.running
    ):
        engine.step()  # prefills

    # (a mixed step's new request ends with its first token: it never joins the decodes)
    once = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)

    def add_mixed() -> None:
        if mixed:
            prompt = [rng.randint(0, 4000) for _ in range(mixed)]
            engine.add_request(engine.next_request_id(), {"prompt_token_ids": prompt}, once)

    for _ in range(3):
        add_mixed()
        engine.step()  # warm steps
    times: dict[str, float] = defaultdict(float)
    _wrap(core.scheduler, "schedule", "schedule", times)
    _wrap(core.scheduler, "update_from_output", "update", times)
    _wrap(core.scheduler, "plan_grammar_fill", "fill", times)
    _wrap(core.scheduler.grammar, "give_grammar_tokens", "fill", times)
    _wrap(runner.grammar, "apply_bitmask", "mask", times)
    _wrap(runner, "_update_states", "prepare", times)
    _wrap(runner, "_prepare_inputs", "prepare", times)
    _wrap(runner, "_run_model", "forward", times)
    _wrap(runner, "_sample", "sample", times)
    unwrap_apply = _wrap(StepResult, "apply", "wait", times)  # (a class: undone below)
    unwrap_fill_wait = _wrap(FillJob, "wait", "fill", times)
    _wrap(engine.frontend, "process_outputs", "frontend", times)
    encoder = Encoder()
    _wrap(encoder, "encode", "encode", times)

    def one_step() -> None:
        add_mixed()
        if inline_frontend:
            engine.step()
        else:
            encoder.encode(core.step())

    cuda = runner.device.type == "cuda"
    # Pass 1: wall times of the stages, no profiler (it slows every launch down).
    if cprofile is not None:
        cprofile.enable()
    mixed_before = core.scheduler.stats.num_mixed_steps
    first_pass, undo = record_steps(core.scheduler)
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    wall = time.perf_counter() - t0
    undo()
    mixed_steps = core.scheduler.stats.num_mixed_steps - mixed_before
    if cprofile is not None:
        cprofile.disable()
    row: dict[str, Any] = {stage: times[stage] / steps * 1e6 for stage in STAGES}
    row["step"] = wall / steps * 1e6
    row["other"] = row["step"] - sum(row[s] for s in STAGES)
    row["gpu"] = row["replay"] = row["device"] = None
    row["kernels"] = {}
    if cuda:
        # Pass 2: the same steps under torch.profiler, for the kernels' device time.
        from torch.profiler import ProfilerActivity, profile, record_function

        planned, undo = record_steps(core.scheduler)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    with record_function(STEP_MARK):
                        one_step()
                torch.cuda.synchronize()
        finally:
            undo()
        # The kernels' times come from the exported trace, per step kept in it: it may
        # keep only the last steps (on the H200, 12 of 50).
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{trace_dir or tmp}/trace-{batch}.json"
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        # The step's range on the device side counts the steps the trace kept; the host
        # side's ranges are all there.
        marks = [e for e in events if e.get("name") == STEP_MARK and e.get("ph") == "X"]
        on_gpu = [e for e in marks if e.get("cat") == "gpu_user_annotation"]
        kept = min(max(len(on_gpu or marks), 1), steps)
        kernels = [
            (e["name"], e["dur"] / kept)
            for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"
        ]
        per_kernel: dict[str, float] = defaultdict(float)
        launches: dict[str, int] = defaultdict(int)
        for name, us in kernels:
            per_kernel[name[:60]] += us
            launches[name[:60]] += 1
        row["gpu"] = sum(per_kernel.values())
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top_kernels]
        # (µs and launches a step)
        row["kernels"] = {name: [round(us, 1), launches[name] / kept] for name, us in top}
        row["classes"] = class_times(kernels)
        if rates is not None and planned:
            # (the floors of the steps the trace kept: the last ones)
            shape = ModelShape.from_hf_config(core.config.model.hf_config)
            dtype_bytes = DTYPE_BYTES[str(core.config.model.dtype).removeprefix("torch.")]
            floors = dict.fromkeys(KERNEL_CLASSES, 0.0)
            for rows, sampled in planned[-kept:]:
                for cls, sec in class_floors(shape, dtype_bytes, rows, sampled, rates).items():
                    floors[cls] += sec * 1e6 / len(planned[-kept:])
            row["floors"] = {cls: round(us, 1) for cls, us in floors.items()}
        row["device"] = device_gaps(events)
        row["replay"] = _time_replay(runner, batch)
    unwrap_apply()
    unwrap_fill_wait()
    engine.abort_request([*engine.frontend.output_processor.states])  # the frontend forgets
    while core.has_unfinished_requests():
        core.step()
    row["batch"] = batch
    row["input_len"] = input_len
    row["mixed"] = mixed
    row["mixed_steps"] = mixed_steps  # (of the first, untraced pass)
    row["tokens_per_step"] = sum(q for rows, _ in first_pass for q, _ in rows) / max(
        len(first_pass), 1
    )
    row["graphs"] = runner.graphs is not None
    return row


def print_classes(rows: Sequence[dict[str, Any]]) -> None:
    """µs per step by kernel class, each beside its floor where the card's rates are
    known (floor / time: how close the class runs to its floor)."""
    if not any("classes" in r for r in rows):
        return
    print("µs per step by kernel class (time / floor / floor÷time)")
    print(f"{'batch':>6} {'input':>6} {'mixed':>6} " + " ".join(f"{c:>24}" for c in KERNEL_CLASSES))
    for r in rows:
        if "classes" not in r:
            continue
        cells = []
        for c in KERNEL_CLASSES:
            t = r["classes"][c]
            floor = r.get("floors", {}).get(c)
            if floor:
                cells.append(f"{t:.0f} / {floor:.0f} / {floor / t if t else 0:.2f}")
            else:
                cells.append(f"{t:.0f}")
        print(
            f"{r['batch']:>6} {r['input_len']:>6} {r['mixed']:>6} "
            + " ".join(f"{x:>24}" for x in cells)
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m asyncllm.bench.step_profile",
        description=__doc__.split("\n\n")[0],
    )
    add_engine_args(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument(
        "--input-len",
        type=int,
        nargs="+",
        default=[128],
        help="prompt tokens (several: a row each)",
    )
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="also prefill a new request of this many tokens in every timed step",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", help="write cProfile stats of the timed steps here")
    parser.add_argument("--trace-dir", help="write each batch's torch.profiler trace here")
    parser.add_argument(
        "--kernels", type=int, default=8, help="list this many kernels of each row, longest first"
    )
    parser.add_argument(
        "--inline-frontend",
        action="store_true",
        help="time LLMEngine.step (the frontend on the core's thread) instead of the core's",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="constrain every request with a JSON schema (an array of 64 short strings)",
    )
    add_peak_rate_args(parser)
    args = parser.parse_args(argv)
    from asyncllm import LLM

    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", max(args.batch) + (2 if args.mixed else 0))
    kwargs.setdefault("max_model_len", max(args.input_len + [args.mixed]) + args.steps + 64)
    t0 = time.perf_counter()
    llm = LLM(multiprocess=False, **kwargs)
    client: Any = llm.engine.client  # (the in-process client: its core is here)
    startup = dataclasses.asdict(client.core.executor.worker.report)
    startup["engine_s"] = time.perf_counter() - t0
    prof = cProfile.Profile() if args.cprofile else None
    config = client.core.config
    device = str(config.model.device)
    rates = None
    if device.startswith("cuda"):
        import torch

        rates = rates_from_args(args, torch.cuda.get_device_name(config.model.device))
    try:
        rows = [
            profile_batch(
                llm,
                b,
                n,
                args.steps,
                args.seed,
                prof,
                args.trace_dir,
                args.inline_frontend,
                args.structured,
                args.mixed,
                rates,
                args.kernels,
            )
            for n in args.input_len
            for b in args.batch
        ]
    finally:
        llm.shutdown()
    if prof is not None:
        prof.dump_stats(args.cprofile)
    cols = ("batch", "input_len", "step", *STAGES, "other", "gpu", "replay")
    print("µs per decode step" + (" (CUDA graphs)" if rows[0]["graphs"] else ""))
    print(" ".join(f"{c:>9}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>9.0f}" if r[c] is not None else f"{'-':>9}" for c in cols))
    result = {"benchmark": "step_profile", "rows": rows, "startup": startup}
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in startup["seconds"].items())
    print(f"start-up {startup['engine_s']:.1f} s in all; {stages}")
    print(
        "memory: weights {:.2f} GiB, activation peak {:.2f} GiB, CUDA graphs {:.2f} GiB "
        "(estimated {:.2f}), KV cache {:.2f} GiB in {} blocks, {:.1f} requests of "
        "max_model_len at once".format(
            startup["weights_bytes"] / 2**30,
            startup["activation_peak_bytes"] / 2**30,
            startup["graph_bytes"] / 2**30,
            startup["graph_estimate_bytes"] / 2**30,
            startup["kv_cache_bytes"] / 2**30,
            startup["num_blocks"],
            startup["max_concurrency"],
        )
    )
    for r in rows:
        if (gaps := r["device"]) is not None:
            print(
                f"batch {r['batch']}: device idle between steps {gaps['between_us']:.1f} µs "
                f"a step, {100 * gaps['between_frac']:.2f}% of the time; idle in all "
                f"{100 * gaps['idle_frac']:.2f}% (over {gaps['steps']} steps of the trace)"
            )
        for name, (us, n) in r["kernels"].items():
            print(f"  batch {r['batch']}: {us:>8.1f} µs {n:>6.1f} launches  {name}")
    print_classes(rows)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
