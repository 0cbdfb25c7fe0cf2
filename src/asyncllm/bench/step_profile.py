"""Where one decode step's time goes, at a given batch size, in µs per step.

The engine runs in this process (`multiprocess=False`); `--batch` requests of
`--input-len` random tokens are prefilled, then `--steps` decode steps are timed. Host
stages are wall times of the engine's own functions (wrapped, not changed):

- schedule: `Scheduler.schedule`
- prepare: the runner's batch update and input buffers (`_update_states`, `_prepare_inputs`)
- forward: launching the model (a CUDA-graph replay or eager launches)
- sample: sampling, including the wait for the device to finish the step
- update: the scheduler taking the step's tokens (`update_from_output`)
- frontend: turning core outputs into `RequestOutput`s (`Frontend.process_outputs`)

GPU time is the sum of the step's kernel times from a `torch.profiler` trace (CUDA only).

    python -m asyncllm.bench.step_profile --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --skip-tokenizer-init --dtype bfloat16 --batch 1 256
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from asyncllm.bench.common import add_engine_args, engine_kwargs

STAGES = ("schedule", "prepare", "forward", "sample", "update", "frontend")


def _wrap(obj: Any, name: str, stage: str, times: dict[str, float]) -> None:
    fn: Callable[..., Any] = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[stage] += time.perf_counter() - t0

    setattr(obj, name, timed)


def profile_batch(llm: Any, batch: int, input_len: int, steps: int, seed: int) -> dict[str, Any]:
    import torch

    from asyncllm import SamplingParams

    engine = llm.engine
    core = engine.client.core
    runner = core.executor.worker.runner
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 16)
    for _ in range(batch):
        prompt = [rng.randint(0, 10000) for _ in range(input_len)]
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": prompt}, params)
    while len(core.scheduler.waiting) or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in core.scheduler.running
    ):
        engine.step()  # prefills
    for _ in range(3):
        engine.step()  # warm decode steps
    times: dict[str, float] = defaultdict(float)
    _wrap(core.scheduler, "schedule", "schedule", times)
    _wrap(core.scheduler, "update_from_output", "update", times)
    _wrap(runner, "_update_states", "prepare", times)
    _wrap(runner, "_prepare_inputs", "prepare", times)
    _wrap(runner, "_run_model", "forward", times)
    _wrap(runner, "_sample", "sample", times)
    _wrap(engine.frontend, "process_outputs", "frontend", times)
    cuda = runner.device.type == "cuda"
    gpu_us = None
    t0 = time.perf_counter()
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_us = sum(e.device_time for e in kernels) / steps
    else:
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    engine.abort_request([*core.scheduler.requests])
    while engine.has_unfinished_requests():
        engine.step()
    row: dict[str, Any] = {stage: times[stage] / steps * 1e6 for stage in STAGES}
    row["step"] = wall / steps * 1e6
    row["gpu"] = gpu_us
    row["batch"] = batch
    row["graphs"] = runner.graphs is not None
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from asyncllm import LLM

    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", max(args.batch))
    kwargs.setdefault("max_model_len", args.input_len + args.steps + 64)
    llm = LLM(multiprocess=False, **kwargs)
    try:
        rows = [profile_batch(llm, b, args.input_len, args.steps, args.seed) for b in args.batch]
    finally:
        llm.shutdown()
    cols = ("batch", "step", *STAGES, "gpu")
    print("µs per decode step" + (" (CUDA graphs)" if rows[0]["graphs"] else ""))
    print(" ".join(f"{c:>9}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>9.0f}" if r[c] is not None else f"{'-':>9}" for c in cols))
    result = {"benchmark": "step_profile", "rows": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
